#!/usr/bin/env bash
# Local stand-ins for the official base images, for machines that cannot pull from a container
# registry (air-gapped sites, this project's CI). Built from Debian bookworm's apt repositories only:
#
#   localhost/cifar-standin/debian:bookworm             mmdebstrap --variant=minbase bookworm, imported
#   localhost/cifar-standin/python:3.11-slim-bookworm   docker/standins/python.Dockerfile (bookworm's Python 3.11)
#   localhost/cifar-standin/postgres:15-bookworm        docker/standins/postgres.Dockerfile (the official
#                                                       image's POSTGRES_* / initdb.d contract)
#
# Usage: scripts/standin_images.sh [--refresh]     ENGINE=podman (default) or docker
#
# An image that exists is kept (the stand-ins' own layers are cached by the engine); --refresh makes
# the Debian root file system again, so the stand-ins are rebuilt on today's packages. Point the
# stack at them with CIFAR_PYTHON_IMAGE and CIFAR_POSTGRES_IMAGE (docker/env.example). Needs root
# (mmdebstrap) and, for podman, CONTAINERS_CONF as scripts/stack_check/ sets it.
set -euo pipefail

ENGINE=${ENGINE:-podman}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STANDINS=$REPO_ROOT/docker/standins
DEBIAN_IMAGE=localhost/cifar-standin/debian:bookworm
PYTHON_IMAGE=localhost/cifar-standin/python:3.11-slim-bookworm
POSTGRES_IMAGE=localhost/cifar-standin/postgres:15-bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

refresh=0
[[ ${1:-} == --refresh ]] && refresh=1

exists() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

if [[ $refresh == 1 ]] || ! exists "$DEBIAN_IMAGE"; then
    command -v mmdebstrap >/dev/null || { echo "standin_images: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
    work=$(mktemp -d /tmp/cifar-standin.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    echo "standin_images: building $DEBIAN_IMAGE with mmdebstrap" >&2
    mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$work/rootfs.tar" \
        "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
        "deb $SECURITY_MIRROR bookworm-security main"
    "$ENGINE" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' "$work/rootfs.tar" "$DEBIAN_IMAGE" >/dev/null
    rm -f "$work/rootfs.tar"
fi

build() {
    echo "standin_images: building $2" >&2
    "$ENGINE" build --quiet --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" -f "$STANDINS/$1" -t "$2" "$STANDINS" >/dev/null
}
# Both at once (mostly apt downloads); the engine's layer cache makes this seconds when nothing changed.
build postgres.Dockerfile "$POSTGRES_IMAGE" &
postgres_build=$!
build python.Dockerfile "$PYTHON_IMAGE"
wait "$postgres_build"
echo "$PYTHON_IMAGE $POSTGRES_IMAGE"
