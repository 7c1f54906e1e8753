"""A Loadmaster process may fork (to exec a program) while its gRPC threads resolve and
connect: gRPC's fork support, which resets its resolvers around each fork, is off."""

from __future__ import annotations

import os
import subprocess
import sys

# Channels churn on four threads while the main thread forks children that exit at once,
# for 2 s: what the gateway does when it starts its gRPC relay while its sessions connect.
CHURN_AND_FORK = r"""
import os, threading, time
import loadmaster.common  # first, as every service's entry point imports it
import grpc

stop = time.monotonic() + 2.0

def churn():
    while time.monotonic() < stop:
        channel = grpc.insecure_channel("localhost:1")
        try:
            grpc.channel_ready_future(channel).result(timeout=0.01)
        except grpc.FutureTimeoutError:
            pass
        channel.close()

threads = [threading.Thread(target=churn) for _ in range(4)]
for thread in threads:
    thread.start()
forks = 0
while time.monotonic() < stop:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    forks += 1
for thread in threads:
    thread.join()
print(os.environ["GRPC_ENABLE_FORK_SUPPORT"], forks)
"""


def test_forking_while_grpc_threads_connect_neither_hangs_nor_aborts() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHURN_AND_FORK], capture_output=True, text=True, env=env, timeout=30
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("forking beside gRPC threads hung (gRPC's fork handlers are on)") from None
    assert done.returncode == 0, done.stderr[-2000:]
    setting, forks = done.stdout.split()
    assert setting == "false"
    assert int(forks) > 10
    assert "Check failed" not in done.stderr
    assert "fork() handlers" not in done.stderr  # gRPC logs this from its handlers when they are on
