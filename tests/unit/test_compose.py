"""compose.yaml and deploy/prometheus.yml, checked statically: build contexts, start order on
health, ports, scaling, environment as real Settings, Redis durability, the Prometheus target."""

from __future__ import annotations

import itertools
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import (
    COMPOSE,
    CONFIG_PATH,
    HEALTHCHECK_MODULE,
    PROMETHEUS,
    ROOT,
    SERVICES,
    START_STAGES,
    _settings_for,
    compose_default,
    depends_on,
    environment,
    healthcheck_command,
    host_ports,
    port_of,
    services_of,
)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def test_compose_defines_the_suite(compose: dict[str, Any]) -> None:
    assert set(services_of(compose)) == {*SERVICES, "redis", "prometheus", "balancer"}


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
    assert {seen[p] for p in (5555, 8000, 8001)} == {"balancer"}


def test_gateway_scales_behind_the_balancer(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`--scale gateway=N`: no fixed ports or names; HAProxy finds every replica by the service name
    (Docker's DNS) on the ports the gateway listens on."""
    services = services_of(compose)
    gateway = services["gateway"]
    assert not host_ports(gateway) and not gateway.get("ports")
    assert "container_name" not in gateway and "hostname" not in gateway
    balancer = services["balancer"]
    assert depends_on(balancer) == {"gateway": "service_healthy"}
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in balancer["volumes"]}
    config = (COMPOSE.parent / mounts["/usr/local/etc/haproxy/haproxy.cfg"]).read_text()
    assert "nameserver engine 127.0.0.11:53" in config
    settings = _settings_for(compose, "gateway", monkeypatch).gateway
    listens = {
        "gateways_edge": port_of(settings.edge.bind.removeprefix("tcp://")),
        "gateways_grpc": port_of(settings.listen_address),
        "gateways_http": settings.http_port,
    }
    for backend, port in listens.items():
        section = config.split(f"backend {backend}\n", 1)[1].split("\n\n", 1)[0]
        assert f"server-template gw 16 gateway:{port} check" in section, backend
        assert ("", port) in host_ports(balancer)


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
    assert compose_default(redis["image"]).split(":")[0] in ("redis", "docker.io/library/redis")
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


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_builds_from_the_base_image_variable_defaulting_to_slim_python(
    compose: dict[str, Any], service: str
) -> None:
    """An air-gapped site builds from its own base (`make images` writes LOADMASTER_BASE_IMAGE to .env)."""
    args = services_of(compose)[service]["build"]["args"]
    assert args["BASE_IMAGE"] == "${LOADMASTER_BASE_IMAGE:-python:3.11-slim}"


def test_redis_and_prometheus_images_are_variables_defaulting_to_the_registry_images(
    compose: dict[str, Any],
) -> None:
    services = services_of(compose)
    assert services["redis"]["image"] == "${LOADMASTER_REDIS_IMAGE:-redis:7.4}"
    assert services["prometheus"]["image"] == "${LOADMASTER_PROMETHEUS_IMAGE:-prom/prometheus:v3.4.0}"
    # Debian's redis-server (the local image) has no entrypoint that turns protected mode off.
    words = [str(w) for w in services["redis"]["command"]]
    assert words[words.index("--protected-mode") + 1] == "no"


def test_model_pool_builds_cpu_torch_unless_told_otherwise(compose: dict[str, Any]) -> None:
    args = services_of(compose)["model-pool"]["build"]["args"]
    assert compose_default(args["TORCH_INDEX_URL"]) == "https://download.pytorch.org/whl/cpu"


def test_compose_file_has_no_top_level_name_for_docker_compose_1(compose: dict[str, Any]) -> None:
    """docker-compose 1.29 (Debian's) rejects `name:`; the project name comes from .env or -p."""
    assert "name" not in compose
