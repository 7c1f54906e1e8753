#!/usr/bin/env bash
# Make a Docker image from Debian packages alone, for hosts that reach no container registry:
#   docker/debootstrap-image.sh python TAG   Debian bookworm + Python 3.11 (Debian's) + pip, in a
#                                            venv at /opt/python that is first on PATH, so
#                                            `python` and `pip` work as in python:3.11-slim
#   docker/debootstrap-image.sh redis TAG    Debian bookworm + Debian's redis-server (7.0)
#   docker/debootstrap-image.sh prometheus TAG
#                                            Debian bookworm + Debian's prometheus (2.42) and wget
#   docker/debootstrap-image.sh haproxy TAG  Debian bookworm + Debian's haproxy (2.6), laid out as
#                                            the haproxy image: config at
#                                            /usr/local/etc/haproxy/haproxy.cfg
# debootstrap writes a minimal root file system into a temporary folder; `docker import` turns it
# into a one-layer image. Runs as root (debootstrap chroots). Needs debootstrap and a Debian mirror
# ($DEBIAN_MIRROR, default http://deb.debian.org/debian).
set -euo pipefail

kind=${1:?usage: $0 python|redis|prometheus|haproxy TAG}
tag=${2:?usage: $0 python|redis|prometheus|haproxy TAG}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=bookworm

say() { printf '==> %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then echo "$0: debootstrap needs root" >&2; exit 1; fi
command -v debootstrap >/dev/null || { echo "$0: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }

case "$kind" in
  python) include=python3,python3-venv,ca-certificates ;;
  redis) include=redis-server ;;
  prometheus) include=prometheus,wget ;;
  haproxy) include=haproxy ;;
  *) echo "$0: unknown kind $kind (python, redis, prometheus or haproxy)" >&2; exit 2 ;;
esac

root=$(mktemp -d "${TMPDIR:-/tmp}/loadmaster-rootfs.XXXXXX")
# mktemp makes the folder 0700, and it becomes the image's `/`: the services' own user
# (uid 10001) could not even find python.
chmod 755 "$root"
trap 'rm -rf "$root"' EXIT

say "debootstrap --variant=minbase --include=$include $suite ($mirror) into $root"
# No daemon may start inside the chroot while packages are configured.
debootstrap --variant=minbase --include="$include" "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"

changes=()
if [ "$kind" = python ]; then
  say "python3 -m venv /opt/python (pip from Debian's ensurepip wheel)"
  chroot "$root" /usr/bin/python3 -m venv /opt/python
  chroot "$root" /opt/python/bin/python -m pip --version
  changes+=(--change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
            --change 'ENV LANG=C.UTF-8'
            --change 'CMD ["python3"]')
elif [ "$kind" = redis ]; then
  # As the redis image: data in /data; reachable from other containers (no config file, so
  # protected mode would refuse them).
  mkdir -p "$root/data"
  changes+=(--change 'WORKDIR /data'
            --change 'EXPOSE 6379'
            --change 'CMD ["redis-server", "--protected-mode", "no"]')
elif [ "$kind" = haproxy ]; then
  # As the haproxy image: the config where it looks (its STOPSIGNAL, SIGUSR1, is not a
  # `docker import --change`: compose.yaml's stop_signal says it).
  mkdir -p "$root/usr/local/etc/haproxy"
  changes+=(--change 'CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]')
else
  # As the prom/prometheus image: the binary is the entrypoint, its flags the command.
  mkdir -p "$root/prometheus"
  changes+=(--change 'WORKDIR /prometheus'
            --change 'EXPOSE 9090'
            --change 'ENTRYPOINT ["/usr/bin/prometheus"]'
            --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]')
fi

say "trimming apt lists, caches, docs and man pages"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/log/*

say "docker import -> $tag"
tar -C "$root" --numeric-owner -c . | docker import "${changes[@]}" \
  --message "loadmaster: debootstrap $suite minbase + $include" - "$tag" >/dev/null
docker image ls "$tag" --format '    {{.Repository}}:{{.Tag}}  {{.Size}}'
