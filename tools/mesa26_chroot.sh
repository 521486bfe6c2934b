#!/usr/bin/env bash
# Runs kjarni's code on Mesa 26's lavapipe, whose VK_KHR_cooperative_matrix gives Dawn subgroup
# matrices on a CPU (f16 x f16 -> f32 at 8 x 8 x 8, subgroup size 8): the tensor-core attention
# (attention_tc.tmpl.wgsl, which has 8 x 8 variants) can then be tested without a GPU. Mesa 26
# needs Debian trixie's libraries (glibc 2.39, LLVM 19), so it lives in a trixie chroot with its
# own Python venv holding pyproject.toml's dependencies and test extra; this checkout is
# bind-mounted at the same path and imported through PYTHONPATH (nothing is installed into it).
# Needs root, debootstrap (installed with apt-get where missing) and the Debian and PyPI mirrors.
#
#   tools/mesa26_chroot.sh setup             # once: about 1.5 minutes, 0.8 GB (idempotent)
#   tools/mesa26_chroot.sh run CMD ...       # CMD in the chroot, in this checkout
#   tools/mesa26_chroot.sh umount            # release the chroot's mounts
#
#   tools/mesa26_chroot.sh run env KJARNI_WEBGPU_RUNTIME=dawn python -m pytest -p no:cacheprovider \
#       tests/test_gpu_kernels.py -k attention_tc      # 10 tests, about 4 minutes
#
# KJARNI_MESA26_ROOT moves the chroot (default /tmp/kjarni-mesa26). The 16 x 16 kernels (matmul_tc)
# do not run there: that lavapipe offers 8 x 8 x 8 only (eighteenth session, docs/gpu-kernels.md).
set -euo pipefail
ROOT=${KJARNI_MESA26_ROOT:-/tmp/kjarni-mesa26}
REPO=$(cd "$(dirname "$0")/.." && pwd)
MIRROR=http://deb.debian.org/debian

mounted() { mountpoint -q "$ROOT/$1"; }
mnt() { mounted "$1" || { mkdir -p "$ROOT/$1"; mount "${@:2}" "$ROOT/$1"; }; }
mount_all() {
    mnt proc -t proc proc
    mnt sys -t sysfs sys
    mnt dev --bind /dev
    mnt dev/pts --bind /dev/pts
    mnt tmp -t tmpfs tmpfs
    mnt "${REPO#/}" --bind "$REPO"
}
in_root() {
    chroot "$ROOT" env -i HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        PIP_CERT=/etc/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH="$REPO" PYTHONDONTWRITEBYTECODE=1 \
        XDG_RUNTIME_DIR=/tmp "$@"
}

case "${1:-}" in
setup)
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap
    if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
        if findmnt -rn -o TARGET | grep -q "^$ROOT/"; then
            echo "$ROOT has mounts from an unfinished setup: run '$0 umount' first" >&2
            exit 1
        fi
        rm -rf --one-file-system "$ROOT"
        debootstrap --variant=minbase trixie "$ROOT" "$MIRROR"
    fi
    printf 'deb %s trixie main\ndeb %s trixie-backports main\n' "$MIRROR" "$MIRROR" > "$ROOT/etc/apt/sources.list"
    cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
    # The host's CA bundle, so pip in the chroot trusts what the host trusts (a proxy's CA included).
    cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/host-ca.crt"
    mount_all
    if ! in_root dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | grep -q '^2[6-9]'; then
        in_root apt-get update -qq
        in_root apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates
        in_root apt-get install -y -qq --no-install-recommends -t trixie-backports mesa-vulkan-drivers
        in_root apt-get clean
    fi
    # pyproject.toml's dependencies and test extra, read by the host's Python (3.11 has tomllib).
    mapfile -t deps < <(python3 -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))' "$REPO/pyproject.toml")
    [ -x "$ROOT/opt/venv/bin/python" ] || in_root python3 -m venv /opt/venv
    in_root /opt/venv/bin/pip install -q --no-cache-dir "${deps[@]}"
    echo "ready: $0 run CMD"
    ;;
run)
    shift
    [ -x "$ROOT/opt/venv/bin/python" ] || { echo "no chroot at $ROOT: run '$0 setup' first" >&2; exit 1; }
    mount_all
    case "$PWD" in "$REPO" | "$REPO"/*) dir=$PWD ;; *) dir=$REPO ;; esac
    in_root sh -c 'cd "$0" && exec "$@"' "$dir" "$@"
    ;;
umount)
    findmnt -rn -o TARGET | grep "^$ROOT/" | sort -r | while read -r m; do umount "$m" || umount -l "$m"; done
    ;;
*)
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
