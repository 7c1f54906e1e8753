"""deploy/kubernetes renders with kustomize and validates against the Kubernetes schemas.

No cluster runs these manifests in our tests: this checks that every overlay renders, that every
object is valid for the Kubernetes API (kubernetes-validate, strict: unknown fields are errors),
that the probes, drains, disruption budgets and scrape annotations are there, and that the
settings each pod gets through LOADMASTER_* variables and its config file load as real Settings.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from loadmaster.common.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
SERVICES = ("gateway", "scheduler", "model-pool", "gpu-broker", "metrics")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def render(overlay: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=["cpu", "nvidia"])
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
    }


def test_every_object_is_valid_for_the_kubernetes_api(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_a_misspelt_field(objects: list[dict[str, Any]]) -> None:
    broken = yaml.safe_load(yaml.safe_dump(workloads(objects)["gateway"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_every_service_runs_with_probes_a_drain_and_the_shared_config(objects: list[dict[str, Any]]) -> None:
    found = workloads(objects)
    assert set(SERVICES) | {"redis"} <= set(found)
    for name in SERVICES:
        pod = found[name]["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert {"readinessProbe", "livenessProbe"} <= set(container), name
        assert pod["terminationGracePeriodSeconds"] >= 30, name
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/etc/loadmaster/loadmaster.yaml" in mounts, name
        secrets = [e for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
        assert any(e["valueFrom"]["secretKeyRef"]["name"] == "loadmaster-internal" for e in secrets), name
    for name in ("gateway", "model-pool"):
        assert "preStop" in found[name]["spec"]["template"]["spec"]["containers"][0]["lifecycle"]
    budgets = {
        o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for o in objects
        if o["kind"] == "PodDisruptionBudget"
    }
    assert budgets == {"gateway", "model-pool"}
    annotations = found["metrics"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8002"


def test_the_nvidia_overlay_runs_a_worker_and_a_broker_per_gpu_node() -> None:
    found = workloads(render("nvidia"))
    for name in ("model-pool", "gpu-broker"):
        assert found[name]["kind"] == "DaemonSet"
        assert found[name]["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    [worker] = found["model-pool"]["spec"]["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert found["gpu-broker"]["spec"]["template"]["spec"]["hostPID"] is True


def _environment(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal variables, `$(VAR)` references replaced by a placeholder."""
    env = {}
    for entry in container["env"]:
        value = entry.get("value", "from-the-cluster")
        env[entry["name"]] = re.sub(r"\$\(([A-Z_]+)\)", "from-the-cluster", value)
    return env


def test_each_pods_settings_load(
    objects: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap"]
    config = tmp_path / "loadmaster.yaml"
    config.write_text(config_map["data"]["loadmaster.yaml"])
    for name, workload in workloads(objects).items():
        if name == "redis":
            continue
        for key in list(os.environ):
            if key.startswith("LOADMASTER_") or key == "REDIS_URL":
                monkeypatch.delenv(key)
        [container] = workload["spec"]["template"]["spec"]["containers"]
        for key, value in _environment(container).items():
            if key.startswith("LOADMASTER_"):
                monkeypatch.setenv(key, value)
        settings = load_settings(config)  # unknown keys or bad values raise here
        assert str(settings.repository_path) == "/etc/loadmaster/models"
        assert settings.log_format == "json"
