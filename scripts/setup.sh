#!/usr/bin/env bash
# Installs everything hiber needs on a Debian bookworm machine, idempotently:
# Debian packages, CRIU 4.1.1 (built once and cached under .deps/), and the Rust build.
# Bookworm's own criu (3.17) cannot dump on kernels after 6.12, hence the source build.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
deps=${HIBER_DEPS:-$repo/.deps}
criu_version=4.1.1
criu_sha256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
criu_dir=$deps/criu-$criu_version
# hiber's patches to CRIU (scripts/criu-patches/*.patch, each says why); the build is redone
# when they change.
patches_dir=$repo/scripts/criu-patches

log() { printf '[setup] %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

packages=(
    build-essential pkg-config protobuf-compiler protobuf-c-compiler libprotobuf-c-dev
    libprotobuf-dev libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev
    libnftables-dev libaio-dev python3-protobuf uuid-dev libdrm-dev iproute2 procps
    util-linux xz-utils patch
    # OpenCL: the ICD loader and its headers, and PoCL's CPU devices, on which the tests
    # run real OpenCL programs (clpeak and PyOpenCL among them).
    ocl-icd-libopencl1 ocl-icd-opencl-dev opencl-headers pocl-opencl-icd clinfo clpeak
    python3-pyopencl
    # Open MPI: the tests run MPI jobs under mpirun, as their users start them; Slurm: a
    # test starts a one-node cluster (its own slurmctld and slurmd) and submits a job to it.
    openmpi-bin libopenmpi-dev slurm-wlm
)

install_packages() {
    local missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return
    log "installing Debian packages: ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The upstream tarball comes from Debian trixie's source package, through the mirror
# this machine already uses (read from its apt sources, never hard-coded).
fetch_criu_tarball() {
    local tarball=$deps/criu_$criu_version.orig.tar.xz
    if [ -f "$tarball" ] && echo "$criu_sha256  $tarball" | sha256sum -c --quiet 2>/dev/null; then
        return
    fi
    local uri
    uri=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 | awk '{print $2}')
    if [ -z "$uri" ]; then
        uri=$(grep -h '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1 | awk '{print $2}')
    fi
    [ -n "$uri" ] || { log "no apt mirror found in /etc/apt/sources*"; exit 1; }
    local src=/etc/apt/sources.list.d/hiber-trixie-src.sources
    if [ ! -f "$src" ]; then
        log "adding a deb-src entry for trixie (CRIU $criu_version source)"
        as_root tee "$src" >/dev/null <<SRC
Types: deb-src
URIs: $uri
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    as_root apt-get update -qq
    mkdir -p "$deps"
    # The .dsc and .debian.tar.xz may be missing on the mirror, which makes apt exit
    # non-zero; the checksum below decides whether we have what we need.
    (cd "$deps" && apt-get source --download-only "criu=$criu_version-*" >/dev/null 2>&1 ||
        apt-get source --download-only criu >/dev/null 2>&1 || true)
    [ -f "$tarball" ] || { log "could not download $tarball"; exit 1; }
    echo "$criu_sha256  $tarball" | sha256sum -c --quiet || { log "checksum mismatch for $tarball"; exit 1; }
}

patches_sum() {
    cat "$patches_dir"/*.patch 2>/dev/null | sha256sum | cut -d' ' -f1
}

# What install_criu records beside the installed CRIU: which patches it was built with, and
# its RPC protocol, so that another clone of hiber (a fresh one for CI) takes it from there
# rather than build it again.
installed=/usr/local/sbin/criu
installed_record=/usr/local/lib/hiber

build_criu() {
    if [ -x "$criu_dir/criu" ] && "$criu_dir/criu" --version 2>/dev/null | grep -q "Version: $criu_version" &&
        [ "$(cat "$criu_dir/patches.sha256" 2>/dev/null)" = "$(patches_sum)" ]; then
        return
    fi
    if [ -x "$installed" ] && "$installed" --version 2>/dev/null | grep -q "Version: $criu_version" &&
        [ "$(cat "$installed_record/criu-patches.sha256" 2>/dev/null)" = "$(patches_sum)" ] &&
        [ -f "$installed_record/criu-rpc.proto" ]; then
        mkdir -p "$criu_dir"
        install -m 0755 "$installed" "$criu_dir/criu"
        install -m 0644 "$installed_record/criu-rpc.proto" "$criu_dir/rpc.proto"
        patches_sum >"$criu_dir/patches.sha256"
        return
    fi
    fetch_criu_tarball
    log "building CRIU $criu_version (about a minute)"
    local work=$deps/criu-build
    rm -rf "$work" && mkdir -p "$work"
    tar -xf "$deps/criu_$criu_version.orig.tar.xz" -C "$work" --strip-components=1
    for p in "$patches_dir"/*.patch; do
        [ -e "$p" ] || continue
        patch -d "$work" -p1 --quiet --forward <"$p" || { log "could not apply $(basename "$p")"; exit 1; }
    done
    make -C "$work" -j"$(nproc)" criu >"$deps/criu-build.log" 2>&1 ||
        { log "CRIU build failed; see $deps/criu-build.log"; tail -n 20 "$deps/criu-build.log" >&2; exit 1; }
    mkdir -p "$criu_dir"
    install -m 0755 "$work/criu/criu" "$criu_dir/criu"
    # Kept for the GPU suite, which builds its own client of the same protocol.
    install -m 0644 "$work/images/rpc.proto" "$criu_dir/rpc.proto"
    patches_sum >"$criu_dir/patches.sha256"
    rm -rf "$work"
}

install_criu() {
    if ! cmp -s "$criu_dir/criu" "$installed" 2>/dev/null; then
        log "installing $installed"
        as_root install -m 0755 "$criu_dir/criu" "$installed"
    fi
    if ! cmp -s "$criu_dir/patches.sha256" "$installed_record/criu-patches.sha256" 2>/dev/null ||
        ! cmp -s "$criu_dir/rpc.proto" "$installed_record/criu-rpc.proto" 2>/dev/null; then
        as_root install -d -m 0755 "$installed_record"
        as_root install -m 0644 "$criu_dir/rpc.proto" "$installed_record/criu-rpc.proto"
        as_root install -m 0644 "$criu_dir/patches.sha256" "$installed_record/criu-patches.sha256"
    fi
}

build_hiber() {
    log "building hiber and the layers it preloads (cargo build --release)"
    (cd "$repo" && cargo build --release --quiet -p hiber -p hiber-agent -p hiber-opencl)
}

install_packages
build_criu
install_criu
[ "${HIBER_SETUP_SKIP_BUILD:-}" = 1 ] || build_hiber
