#!/usr/bin/env bash
# Build the kubegpu image from deployments/container/Dockerfile, unchanged, and run
# `kubegpu info --simulate h100-8` inside it, on a machine that has no Docker engine and
# reaches no image registry (only Debian's archive and PyPI), as our CI machines do.
#
# How: Debian's buildah builds the Dockerfile; the Dockerfile's pinned base image cannot be
# pulled, so a stand-in is made with debootstrap from the Debian mirror that apt already
# uses and tagged with the base's name (Debian bookworm's python3 is 3.11.2, the pinned
# base has 3.11.11: the image layout, entrypoint, user and wheel install are what this
# checks; python3-dev stands for the headers the base image ships). buildah runs the
# result with chroot isolation, because sandboxes like ours refuse the setrlimit calls an
# OCI runtime (crun/runc) makes.
#
# Usage (as root): deployments/container/build-offline.sh [WORKDIR]   (default /tmp/kubegpu-image)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/kubegpu-image}
buildah=(buildah --storage-driver vfs)
base=$(sed -n 's/^FROM \([^ ]*\).*/\1/p' "$repo/deployments/container/Dockerfile" | head -n 1)
version=$("$repo/.venv/bin/python" -c 'import kubegpu; print(kubegpu.__version__)' 2>/dev/null \
    || sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")

need=()
command -v buildah >/dev/null || need+=(buildah)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The mirror apt is configured with (deb822 or one-line sources), so no host is named here.
mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list)

mkdir -p "$work"
if ! "${buildah[@]}" inspect --type image "$base" >/dev/null 2>&1; then
    rm -rf "$work/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-dev bookworm "$work/rootfs" "$mirror" \
        >"$work/debootstrap.log"
    ln -sf python3 "$work/rootfs/usr/bin/python"
    # Trust the same CAs as this machine, so pip inside the build reaches PyPI through any
    # TLS-intercepting proxy this machine is set up for.
    cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/ca-certificates.crt"
    ctr=$("${buildah[@]}" from scratch)
    tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
    "${buildah[@]}" add "$ctr" "$work/rootfs.tar" / >/dev/null
    "${buildah[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$ctr"
    "${buildah[@]}" commit -q "$ctr" "$base" >/dev/null
    "${buildah[@]}" rm "$ctr" >/dev/null
fi

"${buildah[@]}" bud --pull=never --isolation chroot --network host \
    -f "$repo/deployments/container/Dockerfile" -t "kubegpu:$version" "$repo"

ctr=$("${buildah[@]}" from --pull=never "localhost/kubegpu:$version")
trap '"${buildah[@]}" rm "$ctr" >/dev/null' EXIT
echo "--- kubegpu info --simulate h100-8 (as the image's default user)"
"${buildah[@]}" run --isolation chroot "$ctr" -- kubegpu info --simulate h100-8
echo "--- kubegpu info --simulate t4-1 (as the unprivileged user 65532)"
"${buildah[@]}" run --isolation chroot --user 65532 "$ctr" -- kubegpu info --simulate t4-1
