"""The Dockerfiles, checked statically (no Docker engine runs here): contexts, COPY sources,
base, user, ports, healthchecks, CMD, and what each image installs (the gateway gets no torch)."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
import tomllib

import pytest
from deploy_files import (
    CONFIG_PATH,
    HEALTHCHECK_MODULE,
    ROOT,
    SERVICES,
    _installed_distributions,
    _normalize,
    base_image,
    build_arg_defaults,
    build_text,
    copy_sources,
    distribution_closure,
    dockerignore_patterns,
    exec_form,
    image_installs,
    instructions_of,
    is_dockerignored,
    port_of,
    required_imports,
)

from loadmaster.common.config import Settings


@pytest.fixture(scope="module")
def import_providers() -> dict[str, set[str]]:
    return {
        module: {_normalize(d) for d in dists}
        for module, dists in importlib.metadata.packages_distributions().items()
    }


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_dockerfile_exists_and_uses_the_slim_python_base(service: str) -> None:
    assert base_image(service) == "python:3.11-slim"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_base_image_is_a_build_argument(service: str) -> None:
    froms = [i.args.split()[0] for i in instructions_of(service) if i.keyword == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    assert build_arg_defaults(service)["BASE_IMAGE"] == "python:3.11-slim"
    # pip's settings reach the builds as arguments (make images' wheelhouse), never as ENV
    args = {i.args.split("=")[0] for i in instructions_of(service) if i.keyword == "ARG"}
    assert {"PIP_FIND_LINKS", "PIP_NO_INDEX"} <= args
    assert not any("PIP_FIND_LINKS" in i.args for i in instructions_of(service) if i.keyword == "ENV")


def test_model_pool_image_takes_cpu_torch_by_default() -> None:
    assert build_arg_defaults("model-pool")["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_copy_source_exists_in_the_context_and_is_not_dockerignored(service: str) -> None:
    patterns = dockerignore_patterns()
    sources = [s for i in instructions_of(service) if i.keyword in ("COPY", "ADD") for s in copy_sources(i)]
    assert sources, f"{service}: copies nothing"
    for source in sources:
        assert not source.startswith(("/", "..")), f"{service}: {source} is outside the context"
        assert (ROOT / source).exists(), f"{service}: COPY source {source} does not exist"
        assert not is_dockerignored(source, patterns), f"{service}: COPY source {source} is in .dockerignore"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_image_copies_only_proto_common_and_its_own_service(service: str) -> None:
    """Proto, common and the service, and the libs its pyproject depends on (the model-pool's
    lease client is loadmaster-client); nothing else of the repository."""
    sources = {s for i in instructions_of(service) if i.keyword in ("COPY", "ADD") for s in copy_sources(i)}
    project = tomllib.loads((ROOT / "services" / service / "pyproject.toml").read_text())["project"]
    libs = {
        f"libs/{dep.removeprefix('loadmaster-')}"
        for dep in project["dependencies"]
        if dep.startswith("loadmaster-") and (ROOT / "libs" / dep.removeprefix("loadmaster-")).is_dir()
    }
    allowed = {"libs/proto", "libs/common", f"services/{service}", *libs}
    assert {s.rstrip("/") for s in sources} <= allowed
    assert {"libs/proto", "libs/common", f"services/{service}"} <= {s.rstrip("/") for s in sources}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_pip_installs_are_cacheless_and_not_editable(service: str) -> None:
    runs = [i.args for i in instructions_of(service) if i.keyword == "RUN" and "pip install" in i.args]
    assert runs, f"{service}: installs nothing"
    for run in runs:
        for command in re.split(r"&&|;", run):
            if "pip install" not in command:
                continue
            words = shlex.split(command)
            assert "--no-cache-dir" in words, f"{service}: {command.strip()}"
            assert "-e" not in words and "--editable" not in words, f"{service}: {command.strip()}"
    installed = " ".join(runs)
    assert "libs/proto" in installed and "libs/common" in installed and f"services/{service}" in installed


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_image_runs_as_a_non_root_user(service: str) -> None:
    users = [i.args.split(":")[0] for i in instructions_of(service) if i.keyword == "USER"]
    assert users, f"{service}: no USER, the process would run as root"
    assert users[-1] not in ("root", "0")


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_image_exposes_its_ports(service: str) -> None:
    exposed = {
        int(port.split("/")[0])
        for i in instructions_of(service)
        if i.keyword == "EXPOSE"
        for port in i.args.split()
    }
    assert exposed == SERVICES[service][2]


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_image_healthcheck_probes_its_grpc_port(service: str) -> None:
    checks = [i.args for i in instructions_of(service) if i.keyword == "HEALTHCHECK"]
    assert len(checks) == 1, f"{service}: expected one HEALTHCHECK"
    _, _, command = checks[0].partition("CMD ")
    argv = exec_form(command.strip())
    assert argv[:3] == ["python", "-m", HEALTHCHECK_MODULE]
    section = SERVICES[service][1]
    default_port = port_of(Settings.model_fields[section].default.address)
    assert argv[3] == f"127.0.0.1:{default_port}"
    assert default_port in SERVICES[service][2]


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_cmd_starts_the_service_module_with_the_mounted_config(service: str) -> None:
    cmds = [i.args for i in instructions_of(service) if i.keyword == "CMD"]
    assert cmds, f"{service}: no CMD"
    argv = exec_form(cmds[-1])
    package = SERVICES[service][0]
    assert argv == ["python", "-m", f"loadmaster.{package}", "--config", CONFIG_PATH]
    module = argv[2]
    found = list(ROOT.glob(f"services/*/src/{module.replace('.', '/')}"))
    assert found and found[0].is_dir(), f"{module} is not a package under services/*/src/"
    assert found[0].relative_to(ROOT).parts[:2] == ("services", service), "CMD runs another service"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_image_installs_every_module_its_code_imports(
    service: str, import_providers: dict[str, set[str]]
) -> None:
    local, _ = image_installs(service)
    folders = [folder for folder, _ in local]
    closure = distribution_closure(service)
    shipped = {
        f"loadmaster.{p.name}" for folder in folders for p in (ROOT / folder / "src/loadmaster").iterdir()
    }
    for module, where in required_imports(folders).items():
        if module.startswith("loadmaster."):
            assert module in shipped, f"{service}: {where} imports {module}, which the image does not install"
        elif module not in sys.stdlib_module_names and module != "__future__":
            providers = import_providers.get(module, set())
            assert providers & closure, (
                f"{service}: {where} imports {module}; no installed distribution provides it"
            )


def test_gateway_image_installs_no_torch_and_no_model_pool() -> None:
    closure = distribution_closure("gateway")
    assert "torch" not in closure and "loadmaster-model-pool" not in closure
    assert not any(name.startswith(("nvidia-", "onnx")) for name in closure)
    assert {"loadmaster-gateway", "loadmaster-common", "loadmaster-proto", "pyzmq", "grpcio"} <= closure
    text = build_text("gateway").lower()
    for forbidden in ("torch", "model-pool", "model_pool", "onnx"):
        assert forbidden not in text
    # Nor do the distributions it installs pull torch in.
    for dist in ("libs/proto", "libs/common", "services/gateway"):
        declared = (ROOT / dist / "pyproject.toml").read_text().lower()
        assert "torch" not in declared and "loadmaster-model-pool" not in declared, dist


def test_model_pool_image_installs_pinned_torch_and_the_engine_extras() -> None:
    runs = [i.args for i in instructions_of("model-pool") if i.keyword == "RUN" and "pip install" in i.args]
    torch_step = next((n for n, run in enumerate(runs) if "torch==2.13.0" in run), None)
    extras = "services/model-pool[torch,onnx,transformers,openai_process,diffusers]"
    extras_step = next((n for n, run in enumerate(runs) if extras in run), None)
    assert torch_step is not None, "torch==2.13.0 is not installed"
    assert extras_step is not None, (
        "the model-pool is not installed with [torch,onnx,transformers,openai_process,diffusers]"
    )
    assert torch_step <= extras_step, "pin torch before the extras resolve it"


@pytest.mark.parametrize(
    "dist",
    _installed_distributions(),
)
def test_every_installed_distribution_has_a_valid_pyproject(dist: str) -> None:
    data = tomllib.loads((ROOT / dist / "pyproject.toml").read_text())
    assert data["project"]["name"].startswith("loadmaster-")


def test_dockerignore_keeps_the_venv_and_git_out_of_the_context() -> None:
    patterns = dockerignore_patterns()
    assert is_dockerignored(".venv", patterns)
    assert is_dockerignored(".git", patterns)
    assert is_dockerignored("libs/common/src/loadmaster/common/__pycache__/x.pyc", patterns)
    assert not is_dockerignored("libs/common/src/loadmaster/common/config.py", patterns)
