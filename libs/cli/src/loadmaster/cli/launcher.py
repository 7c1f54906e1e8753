"""Start the whole suite on one machine as child processes, and stop it without orphans.

Order: Redis (`REDIS_URL`, else an embedded redis-server: for `loadmaster up` it keeps its
data in `redis.data_dir`, default `.loadmaster/redis` beside the config, so what was changed
at run time survives a restart; docs/admin.md), then metrics, gpu-broker, scheduler,
model-pool and gateway, all at once: each is started with `python -m loadmaster.<svc>
[--config PATH]` (no config: the built-in defaults) in its own process group, and then each is
waited on through gRPC health, in that order (a service retries a peer that is not up yet, and
the imports overlap: the example suite is up in ~2.8 s instead of ~5.3 s on 2 cores). Children also
get SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so nothing is
left behind even after `kill -9` of the launcher.

`stop()` goes the other way, one kind at a time: gateways, workers, scheduler, broker,
metrics, then Redis. Each kind gets SIGTERM and is waited for within its `shutdown_grace_s`
(plus a margin for the process to exit) before the next kind is signalled, so a gateway
finishes its in-flight requests while the workers, scheduler and broker still serve, and
workers release their leases while the broker is still there. What does not exit in time
is killed; `stop()` returns the services that failed (a non-zero exit, or killed).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from loadmaster.cli.redis_server import EmbeddedRedis
from loadmaster.common import internal_auth
from loadmaster.common.child_processes import die_with_parent, signal_group
from loadmaster.common.config import Settings, load_settings
from loadmaster.common.grpc_client import wait_for_health_sync
from loadmaster.common.ports import free_port

__all__ = ["SERVICES", "ServiceProcess", "Suite", "free_port_overrides", "to_env"]


@dataclass(frozen=True, slots=True)
class _ServiceSpec:
    name: str
    module: str
    section: str  # the Settings attribute holding its address


# In dependency order; `stop` goes the other way, so metrics, which every other service reports
# to, goes last (stopped before the broker, it held the broker's stop a second on its last report).
SERVICES: tuple[_ServiceSpec, ...] = (
    _ServiceSpec("metrics", "loadmaster.metrics", "metrics"),
    _ServiceSpec("gpu-broker", "loadmaster.gpu_broker", "gpu_broker"),
    _ServiceSpec("scheduler", "loadmaster.scheduler", "scheduler"),
    _ServiceSpec("model-pool", "loadmaster.model_pool", "model_pool"),
    _ServiceSpec("gateway", "loadmaster.gateway", "gateway"),
)


def to_env(overrides: Mapping[str, Any], prefix: str = "LOADMASTER_") -> dict[str, str]:
    """`{"scheduler": {"address": "x"}}` -> `{"LOADMASTER_SCHEDULER__ADDRESS": "x"}`."""
    env: dict[str, str] = {}
    for key, value in overrides.items():
        name = f"{prefix}{key.upper()}"
        if isinstance(value, Mapping):
            env.update(to_env(value, prefix=f"{name}__"))
        elif isinstance(value, list | tuple):
            import json

            env[name] = json.dumps(list(value))
        else:
            env[name] = str(value)
    return env


def free_port_overrides(host: str = "127.0.0.1") -> dict[str, Any]:
    """Settings overrides that move every listening port to a free one (for tests)."""
    return {
        "gpu_broker": {"address": f"{host}:{free_port()}"},
        "metrics": {"address": f"{host}:{free_port()}", "http_port": free_port()},
        "scheduler": {"address": f"{host}:{free_port()}"},
        "model_pool": {"address": f"{host}:{free_port()}", "data_bind": f"tcp://{host}:{free_port()}"},
        "gateway": {
            "address": f"{host}:{free_port()}",
            "http_port": free_port(),
            "edge": {"bind": f"tcp://{host}:{free_port()}"},
            "gr00t": {"bind": f"tcp://{host}:{free_port()}"},
        },
    }


@dataclass(slots=True)
class ServiceProcess:
    name: str
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # What a copy's settings change from the config's (`{"gateway": {"http_port": ...}}`).
    overrides: dict[str, Any] = field(default_factory=dict)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Suite:
    """The suite's processes. `start()` brings everything up; `stop()` takes everything down."""

    config_path: Path | None  # None: the built-in defaults
    overrides: dict[str, Any] = field(default_factory=dict)
    log_dir: Path | None = None  # None: children write to this process's stderr
    services: tuple[str, ...] = tuple(spec.name for spec in SERVICES)
    workers: int = 1  # model-pool processes; the extra ones take free loopback ports
    # `loadmaster up`: when the config names no internal secret, make one (and an admin token)
    # under .loadmaster/ next to the config and give it to every child (docs/security.md).
    make_credentials: bool = False
    # `loadmaster up`: the embedded Redis keeps its data in `redis.data_dir` (else: a temporary
    # folder, removed at stop, as tests want).
    persist_redis: bool = False
    settings: Settings = field(init=False)
    redis: EmbeddedRedis | None = field(init=False, default=None)
    processes: list[ServiceProcess] = field(init=False, default_factory=list)
    _admin_token_file: Path | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.config_path is not None:
            self.config_path = Path(self.config_path).resolve()
        self.settings = load_settings(self.config_path, **self.overrides)
        auth = self.settings.internal_auth
        if self.make_credentials and auth.secret is None and auth.secret_file is None:
            secret_file, admin_file = internal_auth.ensure_run_secrets(self.settings.config_dir)
            admin_sha256 = hashlib.sha256(admin_file.read_text().strip().encode()).hexdigest()
            self.overrides = {
                **self.overrides,
                "internal_auth": {"secret_file": str(secret_file), "admin_token_sha256": admin_sha256},
            }
            self.settings = load_settings(self.config_path, **self.overrides)
            self._admin_token_file = admin_file

    @property
    def redis_data_dir(self) -> Path | None:
        """Where the embedded Redis keeps its data (None: a temporary folder)."""
        if not self.persist_redis:
            return None
        folder = self.settings.redis.data_dir
        return folder if folder.is_absolute() else self.settings.config_dir / folder

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("LOADMASTER_CONFIG", None)  # children are given --config, or run on the defaults
        env.update(to_env(self.overrides))
        if self.settings.redis_url:
            env["REDIS_URL"] = self.settings.redis_url
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def endpoints(self) -> dict[str, str]:
        s = self.settings
        robots = {"GR00T (ZMQ)": s.gateway.gr00t.bind} if s.gateway.gr00t.enabled else {}
        return {
            "edge (ZMQ)": s.gateway.edge.bind,
            **robots,
            "gateway gRPC": s.gateway.address,
            "gateway HTTP": f"http://{s.gateway.http_host}:{s.gateway.http_port}",
            "openpi (WebSocket)": f"ws://{s.gateway.http_host}:{s.gateway.http_port}/openpi/<model>",
            "metrics": f"http://{s.metrics.http_host}:{s.metrics.http_port}/metrics",
            "scheduler": s.scheduler.address,
            "model-pool": s.model_pool.address,
            "gpu-broker": s.gpu_broker.address,
            "redis": s.redis_url or "",
        }

    def start(self, *, timeout_s: float = 90.0, progress: Any = None) -> None:
        say = progress or (lambda message: None)
        try:
            if not self.settings.redis_url:
                data_dir = self.redis_data_dir
                say(f"starting embedded redis-server (data: {data_dir or 'a temporary folder'})")
                # Assigned first: stop() cleans up a failed start.
                self.redis = EmbeddedRedis(data_dir=str(data_dir) if data_dir is not None else None)
                self.redis.start()
                self.settings = self.settings.model_copy(update={"redis_url": self.redis.url})
            # Every process at once, then each waited for (the module docstring says why).
            launched = [
                self._launch(spec.name, index=index, progress=say)
                for spec in SERVICES
                if spec.name in self.services
                for index in range(self.workers if spec.name == "model-pool" else 1)
            ]
            for service in launched:
                self._wait_healthy(service, timeout_s)
        except BaseException:
            self.stop()
            raise

    def start_service(
        self, name: str, *, index: int = 0, timeout_s: float = 90.0, progress: Any = None
    ) -> ServiceProcess:
        """Start one service process (again, after it was killed) and wait until it is healthy."""
        service = self._launch(name, index=index, progress=progress)
        self._wait_healthy(service, timeout_s)
        return service

    def _launch(self, name: str, *, index: int = 0, progress: Any = None) -> ServiceProcess:
        spec = next(spec for spec in SERVICES if spec.name == name)
        extra_env: dict[str, str] = {}
        address = getattr(self.settings, spec.section).address
        label = name
        overrides: dict[str, Any] = {}
        if name in _COPYABLE and index > 0:
            label = f"{name}-{index}"
            previous = self.service(label)
            if previous is not None:
                address, extra_env, overrides = previous.address, previous.extra_env, previous.overrides
            else:
                host = address.rsplit(":", 1)[0]
                address = f"{host}:{free_port()}"
                overrides = {spec.section: _copy_ports(name, host, address)}
                extra_env = to_env(overrides)
        if progress is not None:
            progress(f"starting {label} ({address})")
        self.processes = [p for p in self.processes if p.name != label]
        service = self._spawn(spec, label, address, extra_env)
        service.overrides = overrides
        self.processes.append(service)
        return service

    def service(self, name: str) -> ServiceProcess | None:
        return next((p for p in self.processes if p.name == name), None)

    def _spawn(
        self, spec: _ServiceSpec, label: str, address: str, extra_env: dict[str, str]
    ) -> ServiceProcess:
        log_path: Path | None = None
        stream: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{label}.log"
            stream = log_path.open("ab")
        process = subprocess.Popen(
            die_with_parent([sys.executable, "-m", spec.module, *self._config_args()]),
            env={**self.env, **extra_env, **self._admin_env(spec.name)},
            stdin=subprocess.DEVNULL,
            stdout=stream,
            stderr=subprocess.STDOUT if stream is not None else None,
            start_new_session=True,
        )
        if stream is not None:
            stream.close()
        return ServiceProcess(label, address, process, log_path, extra_env)

    @property
    def credential_files(self) -> dict[str, str]:
        """The secret and admin token files this suite made (empty when the config named its own)."""
        if self._admin_token_file is None:
            return {}
        return {
            "secret_file": str(self.settings.internal_auth.secret_file),
            "admin_token_file": str(self._admin_token_file),
        }

    def _admin_env(self, service: str) -> dict[str, str]:
        """The admin token goes only to the gateway (admin API keys act through it); the
        others get its SHA-256, enough to check it and not enough to use it."""
        if self._admin_token_file is None or service != "gateway":
            return {}
        return to_env({"internal_auth": {"admin_token_file": str(self._admin_token_file)}})

    def _config_args(self) -> list[str]:
        return [] if self.config_path is None else ["--config", str(self.config_path)]

    def _wait_healthy(self, service: ServiceProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if service.process.poll() is not None:
                raise RuntimeError(
                    f"{service.name} exited with code {service.process.returncode} during start\n"
                    f"{service.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{service.name} not healthy within {timeout_s:.0f}s\n{service.log_tail()}"
                )
            try:
                wait_for_health_sync(service.address, timeout_s=min(1.0, remaining))
                return
            except TimeoutError:
                continue

    def wait_for_models(self, model_ids: list[str], *, timeout_s: float = 60.0) -> None:
        """Block until the scheduler sees every model in `model_ids` READY on some worker."""
        import asyncio

        asyncio.run(self._wait_for_models(set(model_ids), timeout_s))  # one loop: grpc.aio binds to it

    async def _wait_for_models(self, wanted: set[str], timeout_s: float) -> None:
        import asyncio

        from loadmaster.cli.status import collect_status

        deadline = time.monotonic() + timeout_s
        while True:
            status = await collect_status(self.settings)
            missing = wanted - {m.model_id for m in status.models if m.state == "READY"}
            failed = [m for m in status.models if m.model_id in missing and m.error]
            if failed:
                raise RuntimeError(f"model {failed[0].model_id} failed to load: {failed[0].error}")
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"models not READY within {timeout_s:.0f}s: {sorted(missing)}")
            await asyncio.sleep(0.1)

    def exited(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.process.poll() is not None]

    # The supervisor's view (loadmaster.cli.supervisor.SupervisedSuite): processes by name,
    # the embedded redis-server as "redis".

    def crashed(self) -> list[tuple[str, int]]:
        """(name, exit status) of every process that has exited, Redis included."""
        dead = [(p.name, p.process.returncode) for p in self.exited()]
        if self.redis is not None and (code := self.redis.exited()) is not None:
            dead.insert(0, ("redis", code))
        return dead

    def restart(self, name: str, *, timeout_s: float = 60.0) -> None:
        """Start `name` again on its address (Redis: its port, password and AOF) and wait until
        it is healthy; one that does not get there is killed, so it shows up in `crashed()`."""
        if name == "redis":
            if self.redis is None:
                raise RuntimeError("no embedded redis-server to restart")
            self.redis.restart(timeout_s)
            return
        spec_name = _spec_name(name)
        index = int(name.removeprefix(spec_name + "-")) if name != spec_name else 0
        try:
            self.start_service(spec_name, index=index, timeout_s=timeout_s)
        except (RuntimeError, TimeoutError):
            service = self.service(name)
            if service is not None:
                signal_group(service.process, signal.SIGKILL)
                service.process.wait()
            raise

    def log_tail(self, name: str, lines: int = 20) -> str:
        service = self.service(name)
        return service.log_tail(lines) if service is not None else ""

    def stop(self, *, margin_s: float = 5.0, progress: Any = None) -> list[str]:
        """Stop in dependency order (gateways, workers, scheduler, broker, metrics, Redis), each
        kind waited for within its `shutdown_grace_s` + `margin_s` before the next; SIGKILL
        what is left. Returns the names of the services that failed (exited non-zero or
        were killed), in stop order."""
        say = progress or (lambda message: None)
        failed: list[str] = []
        for spec in reversed(SERVICES):
            group = [p for p in self.processes if _spec_name(p.name) == spec.name]
            if not group:
                continue
            grace_s = getattr(self.settings, spec.section).shutdown_grace_s
            started = time.monotonic()
            for service in group:
                signal_group(service.process, signal.SIGTERM)
            deadline = started + grace_s + margin_s
            for service in group:
                killed = False
                try:
                    service.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    signal_group(service.process, signal.SIGKILL)
                    service.process.wait()
                    killed = True
                # Anything the service itself started in its group goes too.
                signal_group(service.process, signal.SIGKILL)
                code = service.process.returncode
                if killed or code != 0:
                    failed.append(service.name)
                    say(f"{service.name} failed to stop cleanly: {_describe(code, killed=killed)}")
                else:
                    say(f"{service.name} stopped ({time.monotonic() - started:.1f} s)")
        self.processes.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
            say("redis stopped")
        return failed

    def __enter__(self) -> Suite:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Services a suite may run several copies of: `start_service(name, index=N)` for N > 0 starts
# copy N on free ports of the host in the config (`workers` starts the model-pool copies).
_COPYABLE = ("model-pool", "gateway")


def _copy_ports(name: str, host: str, address: str) -> dict[str, Any]:
    """The settings of a copy of `name` that differ from the first's: its own free ports."""
    if name == "model-pool":
        return {"address": address, "data_bind": f"tcp://{host}:{free_port()}"}
    return {
        "address": address,
        "http_port": free_port(),
        "edge": {"bind": f"tcp://{host}:{free_port()}"},
        "gr00t": {"bind": f"tcp://{host}:{free_port()}"},
    }


def _spec_name(label: str) -> str:
    """`model-pool-2` -> `model-pool`, `gateway-1` -> `gateway`; other labels are their service's name."""
    return next((name for name in _COPYABLE if label.startswith(name)), label)


def _describe(returncode: int | None, *, killed: bool) -> str:
    if killed:
        return "did not exit within its grace period; killed"
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"
