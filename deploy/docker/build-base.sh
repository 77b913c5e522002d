#!/usr/bin/env bash
# Builds a stand-in for python:3.11-slim-bookworm from Debian packages alone, for machines that reach
# a Debian mirror but not Docker Hub:
#
#   deploy/docker/build-base.sh [TAG]          # default TAG: card-base:bookworm
#   docker build -f deploy/Dockerfile --build-arg PYTHON_IMAGE=card-base:bookworm ...
#
# Debian bookworm's python3 is 3.11, as in the official image; python-is-python3 provides the
# `python` the Dockerfile calls, python3-venv the ensurepip that `python -m venv` needs, and passwd
# (part of minbase) groupadd/useradd. Needs root and debootstrap (`apt-get install debootstrap`).
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), SUITE (default bookworm).
set -euo pipefail

tag="${1:-card-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite="${SUITE:-bookworm}"

command -v debootstrap >/dev/null || { echo "build-base.sh: debootstrap is missing (apt-get install debootstrap)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "build-base.sh: debootstrap needs root" >&2; exit 2; }

root="$(mktemp -d "${TMPDIR:-/tmp}/card-base.XXXXXX")"
# The root filesystem holds device nodes and root-owned files: remove it whatever happens.
trap 'rm -rf --one-file-system "$root"' EXIT

debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    "$suite" "$root" "$mirror"

# What the official slim images also leave out: package lists, caches and documentation.
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/tmp/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
# Seen by `docker import` as plain files: the engine supplies its own at run time.
: > "$root/etc/hostname"
: > "$root/etc/resolv.conf"

# docker import keeps no metadata but what --change sets: the PATH and CMD of python:3.11-slim.
tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$tag"
docker image inspect --format '{{.RepoTags}} {{.Size}} bytes' "$tag"
