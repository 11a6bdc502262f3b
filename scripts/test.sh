#!/usr/bin/env bash
# Installs what the tests need (idempotent), then runs every test: unit tests and the
# end-to-end tests against a real CRIU with real processes (root required).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
HIBER_SETUP_SKIP_BUILD=1 bash "$repo/scripts/setup.sh"
cd "$repo"
exec cargo test --workspace --locked "$@"
