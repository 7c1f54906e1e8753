"""A second language against the running suite: the Node client in clients/node/check.mjs.

It loads protos/ with @grpc/proto-loader (as a Node user would) and calls KServe ModelInfer and
ModelStreamInfer, health, reflection v1, an internal RPC with the internal credential, and the
ZMQ edge with the `zeromq` package. The suite here runs with internal auth on (`loadmaster up`
makes the secret), so the internal call must be signed to pass.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadmaster.cli.launcher import Suite, free_port_overrides
from loadmaster.common import internal_auth
from loadmaster.common.credentials import Credentials, Identity
from loadmaster.common.internal_auth import RUN_DIR

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "clients" / "node"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(
    NODE is None or not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists(),
    reason="node or the clients/node packages are missing (`make node` needs npm)",
)

CHECKS = [
    "kserve ModelInfer",
    "kserve ModelStreamInfer",
    "grpc health",
    "reflection v1",
    "internal RPC with the internal credential",
    "zmq edge Observation -> ModelResponse",
]


@pytest.fixture(scope="module")
def secured_suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    folder = tmp_path_factory.mktemp("node-suite")
    config = folder / "loadmaster.yaml"
    config.write_text(
        f"models:\n  repository: {ROOT / 'examples' / 'models'}\n"
        "model_pool:\n  preload: [double]\nmetrics:\n  enabled: false\n"
    )
    suite = Suite(config, overrides=free_port_overrides(), log_dir=folder / "logs", make_credentials=True)
    suite.start(timeout_s=120)
    try:
        internal_auth.setup_client(suite.settings, Identity("cli", "test"))  # to ask for model states
        try:
            suite.wait_for_models(["double"], timeout_s=100)
        finally:
            internal_auth.setup(None)
        yield suite
    finally:
        suite.stop()


def run_node(suite: Suite) -> dict[str, dict[str, object]]:
    secret = (suite.settings.config_dir / RUN_DIR / "internal.secret").read_text().strip().encode()
    identity_key = Credentials(secret, Identity("cli", "test")).identity_key(Identity("node", "check"))
    target = {
        "gateway": suite.settings.gateway.address,
        "edge": suite.settings.gateway.edge.bind,
        "scheduler": suite.settings.scheduler.address,
        "identityKey": identity_key,
    }
    assert NODE is not None
    done = subprocess.run(
        [NODE, str(NODE_DIR / "check.mjs"), json.dumps(target)], capture_output=True, text=True, timeout=120
    )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["check"]] = result
    assert results, done.stdout + done.stderr
    return results


def test_a_node_client_uses_every_contract(secured_suite: Suite) -> None:
    results = run_node(secured_suite)
    failed = {name: r["detail"] for name, r in results.items() if not r["ok"]}
    assert failed == {}
    assert sorted(results) == sorted(CHECKS)
    assert results["internal RPC with the internal credential"]["detail"]["unsigned"] == "UNAUTHENTICATED"  # type: ignore[index]
    assert results["zmq edge Observation -> ModelResponse"]["detail"]["values"] == [1, 3, 5]  # type: ignore[index]
