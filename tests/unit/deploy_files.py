"""Parsing helpers for the deployment-file tests (test_dockerfiles.py, test_compose.py):
Dockerfiles, .dockerignore, compose.yaml and what each image installs."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from loadmaster.common.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]


COMPOSE = ROOT / "compose.yaml"


PROMETHEUS = ROOT / "deploy" / "prometheus.yml"


CONFIG_PATH = "/etc/loadmaster/loadmaster.yaml"


HEALTHCHECK_MODULE = "loadmaster.common.healthcheck"


# compose service / services/<folder> -> (python package, settings section, ports the image serves)
SERVICES: dict[str, tuple[str, str, set[int]]] = {
    "gateway": ("gateway", "gateway", {5555, 5557, 8000, 8001}),
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


_COMPOSE_VARIABLE = re.compile(r"\$\{(\w+):-([^}]*)\}")


def compose_default(value: object) -> str:
    """A compose value with each `${VAR:-default}` replaced by its default (no .env, no variable)."""
    return _COMPOSE_VARIABLE.sub(lambda match: match.group(2), str(value))


def build_arg_defaults(service: str) -> dict[str, str]:
    """The Dockerfile's `ARG NAME=default` values (ARGs without a default are left out)."""
    defaults: dict[str, str] = {}
    for instruction in instructions_of(service):
        if instruction.keyword == "ARG" and "=" in instruction.args:
            name, _, value = instruction.args.partition("=")
            defaults[name.strip()] = value.strip()
    return defaults


def base_image(service: str) -> str:
    """The final stage's FROM, its `${ARG}` replaced by the ARG's default."""
    froms = [i.args.split()[0] for i in instructions_of(service) if i.keyword == "FROM"]
    assert froms, f"{service}: no FROM"
    defaults = build_arg_defaults(service)
    return re.sub(r"\$\{?(\w+)\}?", lambda match: defaults.get(match.group(1), match.group(0)), froms[-1])


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


def _installed_distributions() -> list[str]:
    dists = {"libs/proto", "libs/common"} | {f"services/{s}" for s in SERVICES}
    return sorted(dists)


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
