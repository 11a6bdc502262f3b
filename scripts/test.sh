#!/usr/bin/env bash
# Installs what the tests need (idempotent), then runs every test: unit tests and the
# end-to-end tests against a real CRIU with real processes (root required).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
HIBER_SETUP_SKIP_BUILD=1 bash "$repo/scripts/setup.sh"
cd "$repo"
# The benchmark's parsing and statistics (the benchmark itself runs on the GPU machine).
if ! out=$(python3 -m unittest discover -s bench -p 'test_*.py' 2>&1); then
    echo "$out"
    exit 1
fi
echo "$out" | tail -n 3
exec cargo test --workspace --locked "$@"
