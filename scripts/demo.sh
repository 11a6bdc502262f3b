#!/usr/bin/env bash
# Installs what hiber needs (idempotent), then runs `hiber demo` on its built-in workload.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bash "$repo/scripts/setup.sh"
exec "$repo/target/release/hiber" demo "$@"
