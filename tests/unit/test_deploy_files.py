"""Static checks of the container deployment: Dockerfiles, compose.yaml, prometheus.yml, .dockerignore.

No Docker engine runs where the tests run, so everything a build or `docker compose up` would
trip over is checked by reading the files: paths, COPY sources, ports, health checks, start
order, environment overrides (built into real `Settings`), and what each image installs.
"""

from __future__ import annotations

import ast
import importlib.metadata
import itertools
import json
import os
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from loadmaster.common.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
CONFIG_PATH = "/etc/loadmaster/loadmaster.yaml"
HEALTHCHECK_MODULE = "loadmaster.common.healthcheck"

# compose service / services/<folder> -> (python package, settings section, ports the image serves)
SERVICES: dict[str, tuple[str, str, set[int]]] = {
    "gateway": ("gateway", "gateway", {5555, 8000, 8001}),
    "scheduler": ("scheduler", "scheduler", {50051}),
    "model-pool": ("model_pool", "model_pool", {50052, 5556}),
    "gpu-broker": ("gpu_broker", "gpu_broker", {50053}),
    "metrics": ("metrics", "metrics", {50054, 8002}),
}
# Start order: each service waits (service_healthy) on every service of the stage before it.
START_STAGES: list[set[str]] = [
    {"redis"},
    {"gpu-broker", "metrics"},
    {"scheduler"},
    {"model-pool"},
    {"gateway"},
]


# --- Dockerfile parsing ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and pending):
            continue  # comments (also inside continuations) and blank continuation lines
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if not line:
            continue
        keyword, _, args = line.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return instructions


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def copy_sources(instruction: Instruction) -> list[str]:
    """Context paths a COPY/ADD reads ([] for `--from` copies between stages)."""
    args = instruction.args
    words = exec_form(args) if args.startswith("[") else shlex.split(args)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from") for f in flags):
        return []
    paths = [w for w in words if not w.startswith("--")]
    assert len(paths) >= 2, f"{instruction.keyword} needs a source and a destination: {args}"
    return paths[:-1]


def dockerfile(service: str) -> Path:
    return ROOT / "services" / service / "Dockerfile"


def instructions_of(service: str) -> list[Instruction]:
    return parse_dockerfile(dockerfile(service))


def build_text(service: str) -> str:
    """Every instruction of the Dockerfile (comments dropped), one per line."""
    return "\n".join(f"{i.keyword} {i.args}" for i in instructions_of(service))


def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `**` spans folders, `*` and `?` stay within one."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def is_dockerignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a match on a parent folder excludes the path."""
    parts = Path(relative).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.fullmatch(candidate) for candidate in candidates):
            ignored = not negate
    return ignored


# --- compose parsing ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def services_of(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def host_ports(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host ip, host port) of every published port (short and long syntax)."""
    published: list[tuple[str, int]] = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            if entry.get("published") is not None:
                published.append((str(entry.get("host_ip", "")), int(entry["published"])))
            continue
        spec = str(entry).split("/")[0]
        parts = spec.rsplit(":", 2)
        if len(parts) == 1:
            continue  # container port only: Docker picks an ephemeral host port
        host_ip, host = (parts[0], parts[1]) if len(parts) == 3 else ("", parts[0])
        first, _, last = host.partition("-")
        for port in range(int(first), int(last or first) + 1):
            published.append((host_ip, port))
    return published


def healthcheck_command(service: dict[str, Any]) -> list[str]:
    test = (service.get("healthcheck") or {}).get("test")
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    return list(test or [])


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# --- Dockerfiles ----------------------------------------------------------------------------


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_dockerfile_exists_and_uses_the_slim_python_base(service: str) -> None:
    froms = [i.args.split()[0] for i in instructions_of(service) if i.keyword == "FROM"]
    assert froms, f"{service}: no FROM"
    assert froms[-1] == "python:3.11-slim"


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
    sources = {s for i in instructions_of(service) if i.keyword in ("COPY", "ADD") for s in copy_sources(i)}
    allowed = {"libs/proto", "libs/common", f"services/{service}"}
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


# --- what an image installs covers what its code imports ----------------------------------


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _copy_destinations(service: str) -> dict[str, str]:
    """Container path -> context path, from the Dockerfile's COPY instructions."""
    mapping: dict[str, str] = {}
    for instruction in instructions_of(service):
        if instruction.keyword == "COPY":
            words = [w for w in shlex.split(instruction.args) if not w.startswith("--")]
            for source in words[:-1]:
                mapping[words[-1].rstrip("/")] = source.rstrip("/")
    return mapping


def image_installs(service: str) -> tuple[list[tuple[str, set[str]]], list[Requirement]]:
    """(local distribution folders with extras, named requirements) the Dockerfile pip-installs."""
    copies = _copy_destinations(service)
    local: list[tuple[str, set[str]]] = []
    named: list[Requirement] = []
    for instruction in instructions_of(service):
        if instruction.keyword != "RUN":
            continue
        for command in re.split(r"&&|;", instruction.args):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            for word in words[2:]:
                if word.startswith("-") or "$" in word:
                    continue  # options and build-arg expansions (index URLs)
                path, _, extras = word.partition("[")
                if path.startswith(("/", ".")):
                    folder = copies.get(path.rstrip("/"))
                    assert folder is not None, f"{service}: installs {path}, which no COPY put there"
                    local.append((folder, {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}))
                else:
                    named.append(Requirement(word))
    return local, named


def _local_requirements(folder: str) -> tuple[str, list[str]]:
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    requires = list(project.get("dependencies", []))
    for extra, deps in project.get("optional-dependencies", {}).items():
        requires += [f"{dep}; extra == '{extra}'" for dep in deps]
    return project["name"], requires


def _wanted(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in extras | {""})


def distribution_closure(service: str) -> set[str]:
    """Every distribution the image ends up with (normalized names), following Requires-Dist."""
    local_names: dict[str, tuple[str, list[str]]] = {}
    for folder in {f"services/{s}" for s in SERVICES} | {"libs/proto", "libs/common"}:
        name, requires = _local_requirements(folder)
        local_names[_normalize(name)] = (folder, requires)
    local, named = image_installs(service)
    todo: list[tuple[str, set[str]]] = [(_normalize(_local_requirements(f)[0]), e) for f, e in local]
    todo += [(_normalize(r.name), set(r.extras)) for r in named]
    seen: set[str] = set()
    while todo:
        name, extras = todo.pop()
        key = name + "[" + ",".join(sorted(extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        if name in local_names:
            requires = local_names[name][1]
        else:
            try:
                requires = list(importlib.metadata.distribution(name).requires or [])
            except importlib.metadata.PackageNotFoundError:
                requires = []  # not in this venv: a leaf (its imports are checked only if used)
        for line in requires:
            requirement = Requirement(line)
            if _wanted(requirement, extras):
                todo.append((_normalize(requirement.name), set(requirement.extras)))
    return {key.partition("[")[0] for key in seen}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside `try: ... except ImportError` or `if TYPE_CHECKING:`: optional at runtime."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            for handler in parent.handlers:
                names = ast.unparse(handler.type) if handler.type else ""
                if "ImportError" in names or "ModuleNotFoundError" in names:
                    return True
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test):
            return True
        node = parent
    return False


def required_imports(folders: list[str]) -> dict[str, str]:
    """Top-level module -> first file importing it unconditionally, over the given source folders."""
    found: dict[str, str] = {}
    for folder in folders:
        for path in sorted((ROOT / folder / "src").rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                if _guarded(node, parents):
                    continue
                for name in names:
                    top = (
                        ".".join(name.split(".")[:2])
                        if name.startswith("loadmaster.")
                        else name.split(".")[0]
                    )
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.fixture(scope="module")
def import_providers() -> dict[str, set[str]]:
    return {
        module: {_normalize(d) for d in dists}
        for module, dists in importlib.metadata.packages_distributions().items()
    }


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
    extras_step = next((n for n, run in enumerate(runs) if "services/model-pool[torch,onnx]" in run), None)
    assert torch_step is not None, "torch==2.13.0 is not installed"
    assert extras_step is not None, "the model-pool is not installed with [torch,onnx]"
    assert torch_step <= extras_step, "pin torch before the extras resolve it"


def _installed_distributions() -> list[str]:
    dists = {"libs/proto", "libs/common"} | {f"services/{s}" for s in SERVICES}
    return sorted(dists)


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


# --- compose.yaml ---------------------------------------------------------------------------


def test_compose_defines_the_suite(compose: dict[str, Any]) -> None:
    assert set(services_of(compose)) == {*SERVICES, "redis", "prometheus"}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_builds_from_its_dockerfile_in_the_repo_root_context(
    compose: dict[str, Any], service: str
) -> None:
    build = services_of(compose)[service]["build"]
    assert isinstance(build, dict)
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == ROOT
    assert build["dockerfile"] == f"services/{service}/Dockerfile"
    assert (context / build["dockerfile"]).is_file()


def test_every_build_context_and_dockerfile_exists(compose: dict[str, Any]) -> None:
    for name, service in services_of(compose).items():
        build = service.get("build")
        if build is None:
            assert service.get("image"), f"{name}: neither build nor image"
            continue
        if isinstance(build, str):
            build = {"context": build}
        context = COMPOSE.parent / build.get("context", ".")
        assert context.is_dir(), f"{name}: context {context} missing"
        assert (context / build.get("dockerfile", "Dockerfile")).is_file(), f"{name}: Dockerfile missing"


def test_depends_on_targets_exist_and_healthy_ones_have_a_healthcheck(compose: dict[str, Any]) -> None:
    services = services_of(compose)
    for name, service in services.items():
        for target, condition in depends_on(service).items():
            assert target in services, f"{name} depends on undefined service {target}"
            assert condition in ("service_started", "service_healthy", "service_completed_successfully")
            if condition == "service_healthy":
                assert healthcheck_command(services[target]), (
                    f"{name} waits on {target}, which has no healthcheck"
                )


def test_start_order_follows_health(compose: dict[str, Any]) -> None:
    services = services_of(compose)
    for before, stage in itertools.pairwise(START_STAGES):
        for name in stage:
            deps = depends_on(services[name])
            waits_on = {target for target, condition in deps.items() if condition == "service_healthy"}
            # every service of the previous stage is awaited (directly, or for metrics: it needs no Redis)
            required = before - {"redis"} if name == "metrics" else before
            assert required <= waits_on, f"{name} must wait for {sorted(required)} to be healthy"
    # and the graph has no cycle
    order: list[str] = []
    remaining = {name: set(depends_on(s)) for name, s in services.items()}
    while remaining:
        ready = sorted(name for name, deps in remaining.items() if deps <= set(order))
        assert ready, f"depends_on cycle among {sorted(remaining)}"
        order += ready
        for name in ready:
            del remaining[name]


def test_no_host_port_is_published_twice(compose: dict[str, Any]) -> None:
    seen: dict[int, str] = {}
    for name, service in services_of(compose).items():
        for _, port in host_ports(service):
            assert port not in seen, f"host port {port} published by {seen[port]} and {name}"
            seen[port] = name
    assert {5555, 8000, 8001, 9090} <= set(seen)
    assert {seen[p] for p in (5555, 8000, 8001)} == {"gateway"}


def test_model_pool_scales_no_fixed_ports_or_names(compose: dict[str, Any]) -> None:
    pool = services_of(compose)["model-pool"]
    assert not host_ports(pool)
    assert not pool.get("ports")
    assert "container_name" not in pool
    assert "hostname" not in pool  # every replica advertises its own hostname


def test_no_loadmaster_service_has_a_fixed_container_name(compose: dict[str, Any]) -> None:
    for name in SERVICES:
        assert "container_name" not in services_of(compose)[name], name


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_mounts_the_example_config_read_only(compose: dict[str, Any], service: str) -> None:
    volumes = [str(v) for v in services_of(compose)[service].get("volumes") or []]
    assert "./examples:/etc/loadmaster:ro" in volumes
    assert CONFIG_PATH.startswith("/etc/loadmaster/")
    assert (ROOT / "examples").is_dir()


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_compose_healthcheck_uses_the_healthcheck_module_on_the_listen_port(
    compose: dict[str, Any], service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings_for(compose, service, monkeypatch)
    section = getattr(settings, SERVICES[service][1])
    argv = healthcheck_command(services_of(compose)[service])
    assert argv[0] == "CMD"
    assert argv[1:4] == ["python", "-m", HEALTHCHECK_MODULE]
    assert port_of(argv[4]) == port_of(section.listen_address)


def _settings_for(
    compose: dict[str, Any], service: str, monkeypatch: pytest.MonkeyPatch, config: Path | None = None
) -> Settings:
    """The Settings the service builds from its compose environment (over `config`, if given)."""
    for key in list(os.environ):
        if key.upper().startswith("LOADMASTER_") or key.upper() == "REDIS_URL":
            monkeypatch.delenv(key)
    for key, value in environment(services_of(compose)[service]).items():
        monkeypatch.setenv(key, value)
    return load_settings(config)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_the_mounted_example_config_loads_under_each_service_environment(
    compose: dict[str, Any], service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the container reads: examples/loadmaster.yaml (at CONFIG_PATH) under the compose variables."""
    example = ROOT / "examples" / Path(CONFIG_PATH).name
    if not example.exists():
        pytest.skip(f"{example.relative_to(ROOT)} is not written yet")
    settings = _settings_for(compose, service, monkeypatch, example)
    section = getattr(settings, SERVICES[service][1])
    assert section.listen_address.rsplit(":", 1)[0] == "0.0.0.0", "the environment must win over the file"
    assert settings.scheduler.address == "scheduler:50051"
    assert settings.metrics.address == "metrics:50054"
    # the repository resolves next to the config file, i.e. inside the mounted folder
    assert settings.repository_path.is_relative_to(example.parent)
    if service == "model-pool":
        for model in settings.model_pool.preload:
            assert (settings.repository_path / model).is_dir(), f"preloaded model {model} is missing"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_environment_overrides_are_real_settings_listening_on_all_interfaces(
    compose: dict[str, Any], service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = environment(services_of(compose)[service])
    for key in env:
        assert key == "REDIS_URL" or key.startswith("LOADMASTER_"), key
    settings = _settings_for(compose, service, monkeypatch)  # unknown fields would raise here
    # each LOADMASTER_ variable lands on a real field (pydantic-settings ignores unmatched ones)
    dumped = settings.model_dump()
    for key, value in env.items():
        if key == "REDIS_URL":
            assert settings.redis_url == value
            continue
        node: Any = dumped
        for part in key.removeprefix("LOADMASTER_").lower().split("__"):
            assert isinstance(node, dict) and part in node, f"{key} names no setting"
            node = node[part]
        assert str(node) == value, key
    section = getattr(settings, SERVICES[service][1])
    assert section.listen_address.rsplit(":", 1)[0] == "0.0.0.0"
    assert port_of(section.listen_address) in SERVICES[service][2]


def test_services_reach_each_other_by_service_name(compose: dict[str, Any]) -> None:
    services = services_of(compose)
    for name in SERVICES:
        env = environment(services[name])
        for key, value in env.items():
            if key.endswith("__ADDRESS"):
                host, port = value.rsplit(":", 1)
                assert host in services, f"{name}: {key}={value} names no compose service"
                target = services[host]
                assert port_of(healthcheck_command(target)[4]) == int(port), f"{name}: {key} port"
    for name in ("gateway", "scheduler", "model-pool"):
        env = environment(services[name])
        assert env.get("LOADMASTER_SCHEDULER__ADDRESS") == "scheduler:50051"
        assert env.get("LOADMASTER_METRICS__ADDRESS") == "metrics:50054"
    assert environment(services["gpu-broker"])["REDIS_URL"] == "redis://redis:6379/0"
    gateway = environment(services["gateway"])
    assert gateway["LOADMASTER_GATEWAY__EDGE__BIND"] == "tcp://0.0.0.0:5555"
    assert gateway["LOADMASTER_GATEWAY__HTTP_HOST"] == "0.0.0.0"
    pool = environment(services["model-pool"])
    assert pool["LOADMASTER_MODEL_POOL__DATA_BIND"] == "tcp://0.0.0.0:5556"
    assert environment(services["metrics"])["LOADMASTER_METRICS__HTTP_HOST"] == "0.0.0.0"


def test_redis_is_durable_and_health_checked(compose: dict[str, Any]) -> None:
    redis = services_of(compose)["redis"]
    assert str(redis["image"]).split(":")[0] in ("redis", "docker.io/library/redis")
    command = redis["command"]
    words = shlex.split(command) if isinstance(command, str) else [str(w) for w in command]
    assert words[0] == "redis-server"
    assert "--appendonly" in words and words[words.index("--appendonly") + 1] == "yes"
    named = [str(v).split(":")[0] for v in redis.get("volumes") or []]
    data_volume = next(v for v in named if not v.startswith((".", "/")))
    assert data_volume in (compose.get("volumes") or {})
    assert any(str(v).split(":")[1] == "/data" for v in redis["volumes"])
    assert healthcheck_command(redis)[1:] == ["redis-cli", "ping"]


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in services_of(compose).items():
        for volume in service.get("volumes") or []:
            source = str(volume).split(":")[0] if not isinstance(volume, dict) else volume.get("source", "")
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source} is not declared"
            elif source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: bind mount {source} does not exist"


# --- Prometheus -----------------------------------------------------------------------------


def test_prometheus_scrapes_the_metrics_http_port(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    prometheus = services_of(compose)["prometheus"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in prometheus["volumes"]}
    assert (COMPOSE.parent / mounts["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS
    assert ("", 9090) in host_ports(prometheus)

    http_port = _settings_for(compose, "metrics", monkeypatch).metrics.http_port
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    ]
    assert f"metrics:{http_port}" in targets
    assert http_port in SERVICES["metrics"][2]
    assert "metrics" in depends_on(prometheus)
