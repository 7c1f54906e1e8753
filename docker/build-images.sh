#!/usr/bin/env bash
# `make images`: every image compose.yaml runs, built or made here, step by step.
#
#  1. The base for the five service images: $BASE_IMAGE (default python:3.11-slim) if the engine
#     has it or can pull it; otherwise, for the default, a local Debian bookworm + Python 3.11 +
#     pip image made with debootstrap and `docker import` (docker/debootstrap-image.sh).
#  2. Redis ($REDIS_IMAGE, default redis:7.4) and Prometheus ($PROMETHEUS_IMAGE, default
#     prom/prometheus:v3.4.0) the same way: pulled, or made from Debian's packages; likewise
#     HAProxy ($HAPROXY_IMAGE, default haproxy:2.6), the balancer in front of the gateways.
#  3. A wheelhouse (build/wheelhouse): every wheel the images install, built on this host with
#     its own pip settings (so torch is the local CPU wheel, never a CUDA download). The builds
#     install from it alone, served on 127.0.0.1 while they run (--network host), so they need
#     no index. WHEELHOUSE=0 skips it: the builds then install from PyPI (and torch from
#     $TORCH_INDEX_URL, CPU by default).
#  4. docker build of gateway, scheduler, model-pool, gpu-broker and metrics, tagged
#     loadmaster/<service>:$IMAGE_TAG (what compose.yaml names).
#  5. .env for compose (when absent or written by this script): the project name and the base,
#     Redis, Prometheus and HAProxy images chosen above, so `docker compose up` runs these images.
#
# Environment: BASE_IMAGE, REDIS_IMAGE, PROMETHEUS_IMAGE, HAPROXY_IMAGE, IMAGE_TAG (dev), TORCH_INDEX_URL
# (a CUDA index for GPU workers, e.g. https://download.pytorch.org/whl/cu128; implies
# WHEELHOUSE=0 for the model-pool), WHEELHOUSE (1), WHEELHOUSE_PORT (51019), PIP (the host pip for the wheelhouse),
# SERVICES (the service images to build, default all five).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
REDIS_IMAGE=${REDIS_IMAGE:-redis:7.4}
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-prom/prometheus:v3.4.0}
HAPROXY_IMAGE=${HAPROXY_IMAGE:-haproxy:2.6}
IMAGE_TAG=${IMAGE_TAG:-dev}
WHEELHOUSE=${WHEELHOUSE:-1}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
PIP=${PIP:-.venv/bin/python -m pip}
SERVICES=${SERVICES:-gpu-broker metrics scheduler model-pool gateway}
LOCAL_BASE=loadmaster/base:bookworm-py3.11
LOCAL_REDIS=loadmaster/redis:bookworm
LOCAL_PROMETHEUS=loadmaster/prometheus:bookworm
LOCAL_HAPROXY=loadmaster/haproxy:bookworm
WHEEL_DIR=build/wheelhouse
WHEELHOUSE_PORT=${WHEELHOUSE_PORT:-51019}
mkdir -p build
export DOCKER_BUILDKIT=0  # the classic builder: no frontend image to pull, --network host works

step=0
say() { step=$((step + 1)); printf '\n[%d] %s\n' "$step" "$*"; }
note() { printf '    %s\n' "$*"; }
started=$(date +%s)

docker info >/dev/null 2>&1 || { echo "make images: no Docker engine answers (start dockerd first)" >&2; exit 1; }

# have_or_pull IMAGE: true when the engine has IMAGE or can pull it (60 s at most).
have_or_pull() {
  if docker image inspect "$1" >/dev/null 2>&1; then note "$1: present"; return 0; fi
  note "$1: not present, pulling"
  if timeout 60 docker pull -q "$1" >/dev/null 2>&1; then note "$1: pulled"; return 0; fi
  note "$1: cannot be pulled (no registry reachable?)"
  return 1
}

# resolve VAR DEFAULT LOCAL KIND: set VAR to an image the engine has, making LOCAL when VAR is
# the default and cannot be pulled.
resolve() {
  local var=$1 default=$2 local_tag=$3 kind=$4 image=${!1}
  if have_or_pull "$image"; then return 0; fi
  if [ "$image" != "$default" ]; then
    echo "make images: $var=$image cannot be found or pulled" >&2; exit 1
  fi
  if docker image inspect "$local_tag" >/dev/null 2>&1; then
    note "using $local_tag, made earlier from Debian packages"
  else
    note "making $local_tag from Debian packages (debootstrap + docker import, a few minutes)"
    docker/debootstrap-image.sh "$kind" "$local_tag" | sed 's/^/    /'
  fi
  printf -v "$var" '%s' "$local_tag"
}

say "base image for the services"
resolve BASE_IMAGE python:3.11-slim "$LOCAL_BASE" python
say "Redis image"
resolve REDIS_IMAGE redis:7.4 "$LOCAL_REDIS" redis
say "Prometheus image"
resolve PROMETHEUS_IMAGE prom/prometheus:v3.4.0 "$LOCAL_PROMETHEUS" prometheus
say "HAProxy image (the balancer in front of the gateways)"
resolve HAPROXY_IMAGE haproxy:2.6 "$LOCAL_HAPROXY" haproxy

build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
server_pid=
stop_server() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; }
trap stop_server EXIT

if [ "$WHEELHOUSE" = 1 ]; then
  say "wheelhouse $WHEEL_DIR (host pip: torch stays the local CPU wheel)"
  mkdir -p "$WHEEL_DIR"
  # shellcheck disable=SC2086
  $PIP wheel --quiet --disable-pip-version-check --wheel-dir "$WHEEL_DIR" \
    "hatchling>=1.24" torch==2.13.0 "nvidia-ml-py>=12" \
    "async-timeout>=4.0.3" `# redis-py wants it below Python 3.11.3 (Debian has 3.11.2)` \
    ./libs/proto ./libs/common ./libs/client \
    ./services/gateway ./services/scheduler ./services/gpu-broker ./services/metrics \
    "./services/model-pool[torch,onnx,transformers,diffusers]" `# the extras its Dockerfile installs` \
    >build/wheelhouse.log 2>&1 \
    || { tail -30 build/wheelhouse.log >&2; echo "make images: the wheelhouse failed" >&2; exit 1; }
  note "$(find "$WHEEL_DIR" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEEL_DIR" | cut -f1)"
  # A fixed port: the URL is a build argument, and build arguments are part of the classic
  # builder's cache key, so a port that changed would rebuild every image from its first RUN.
  port=$WHEELHOUSE_PORT
  if ! python3 -c "import socket, sys; socket.socket().bind(('127.0.0.1', $port))" 2>/dev/null; then
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    note "port $WHEELHOUSE_PORT is taken: serving on $port (the build cache will not match)"
  fi
  python3 -m http.server --bind 127.0.0.1 --directory "$WHEEL_DIR" "$port" >/dev/null 2>&1 &
  server_pid=$!
  for _ in $(seq 50); do curl -fs -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
  note "served on http://127.0.0.1:$port/ while the images build"
  build_args+=(--network host --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/" --build-arg PIP_NO_INDEX=1)
else
  build_args+=(--network host)
fi

for service in $SERVICES; do
  say "docker build loadmaster/$service:$IMAGE_TAG (FROM $BASE_IMAGE)"
  args=("${build_args[@]}")
  if [ "$service" = model-pool ]; then
    if [ -n "$TORCH_INDEX_URL" ]; then
      args=(--network host --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
      note "torch from $TORCH_INDEX_URL"
    elif [ "$WHEELHOUSE" = 1 ]; then
      args+=(--build-arg TORCH_INDEX_URL=)
      note "torch: the CPU wheel from the wheelhouse"
    fi
  fi
  t0=$(date +%s)
  log=build/docker-build-$service.log
  if ! docker build "${args[@]}" -f "services/$service/Dockerfile" -t "loadmaster/$service:$IMAGE_TAG" . \
      >"$log" 2>&1; then
    tail -30 "$log" >&2; echo "make images: building $service failed (log: $log)" >&2; exit 1
  fi
  grep -E '^Step [0-9]+/' "$log" | sed 's/^/    /'
  note "built in $(( $(date +%s) - t0 )) s"
done

say ".env for docker compose"
if [ ! -f .env ] || head -1 .env | grep -q '^# written by make images'; then
  cat > .env <<ENV
# written by make images (docker/build-images.sh); delete it to go back to compose.yaml's defaults
COMPOSE_PROJECT_NAME=loadmaster
LOADMASTER_BASE_IMAGE=$BASE_IMAGE
LOADMASTER_REDIS_IMAGE=$REDIS_IMAGE
LOADMASTER_PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE
LOADMASTER_HAPROXY_IMAGE=$HAPROXY_IMAGE
ENV
  sed 's/^/    /' .env
else
  note ".env exists and was not written by make images: add these lines to it yourself"
  note "COMPOSE_PROJECT_NAME=loadmaster LOADMASTER_BASE_IMAGE=$BASE_IMAGE"
  note "LOADMASTER_REDIS_IMAGE=$REDIS_IMAGE LOADMASTER_PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE"
  note "LOADMASTER_HAPROXY_IMAGE=$HAPROXY_IMAGE"
fi

say "images"
for image in "$REDIS_IMAGE" "$PROMETHEUS_IMAGE" "$HAPROXY_IMAGE" $(for s in $SERVICES; do echo "loadmaster/$s:$IMAGE_TAG"; done); do
  docker image ls "$image" --format '    {{.Repository}}:{{.Tag}}  {{.Size}}'
done
printf '\nmake images: done in %d s\n' "$(( $(date +%s) - started ))"
