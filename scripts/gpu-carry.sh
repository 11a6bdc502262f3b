#!/usr/bin/env bash
# Prepares .carry/ for the GPU machine (which has no package registries): a release hiber,
# CRIU with the shared libraries it needs beyond glibc, iproute2's ip (CRIU runs it to save
# and restore a network namespace; that machine has none), and a wrapper that points CRIU
# at them. The GPU suite (gpu/suite.py) runs from there.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bash "$repo/scripts/setup.sh"
carry=$repo/.carry
rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/lib"
install -m 0755 -s "$repo/target/release/hiber" "$carry/bin/hiber"
install -m 0755 -s "$repo/target/release/libhiber_agent.so" "$carry/bin/libhiber_agent.so"
install -m 0755 -s "$repo/target/release/libhiber_opencl.so" "$carry/bin/libhiber_opencl.so"
# The OpenCL test programs and the layer's microbenchmark, built here (the GPU machine has
# no OpenCL headers): they link only the ICD loader, which it has.
mkdir -p "$carry/opencl"
for p in stencil reduce image discover; do
    cc -O2 -Wall -o "$carry/opencl/$p" "$repo/crates/hiber/tests/opencl/$p.c" -lOpenCL
done
for p in launch roundtrip bandwidth handoff; do
    cc -O2 -Wall -o "$carry/opencl/$p" "$repo/bench/opencl/$p.c" -lOpenCL
done
criu=$(ls "$repo"/.deps/criu-*/criu | head -n1)
install -m 0755 "$criu" "$carry/bin/criu.real"
ip=$(command -v ip)
install -m 0755 "$ip" "$carry/bin/ip"
# Every library CRIU and ip link that is not part of glibc travels with them.
ldd "$criu" "$ip" | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*) ;;
        *) cp -L "$lib" "$carry/lib/" ;;
    esac
done
cat >"$carry/bin/criu" <<'WRAP'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
PATH="$here:$PATH" LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/criu.real" "$@"
WRAP
chmod 0755 "$carry/bin/criu"
# The commit the binaries were built from, for the records the suite and the bench write
# (the GPU machine gets a copy of the working tree without .git).
commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$repo" diff --quiet HEAD -- crates 2>/dev/null || commit="$commit+uncommitted"
echo "$commit" >"$carry/COMMIT"
du -sh "$carry"
