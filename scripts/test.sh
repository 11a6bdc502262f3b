#!/usr/bin/env bash
# Installs what the tests need (idempotent), then runs every test: unit tests and the
# end-to-end tests against a real CRIU with real processes (root required).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
HIBER_SETUP_SKIP_BUILD=1 bash "$repo/scripts/setup.sh"
cd "$repo"
# The lints the code claims: formatting, clippy with warnings as errors (the workspace's
# lint table adds undocumented_unsafe_blocks and unsafe_op_in_unsafe_fn).
command -v rustfmt >/dev/null && command -v cargo-clippy >/dev/null ||
    rustup component add rustfmt clippy >/dev/null 2>&1 || true
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked --quiet -- -D warnings
# The benchmark's parsing and statistics (the benchmark itself runs on the GPU machine).
if ! out=$(python3 -m unittest discover -s bench -p 'test_*.py' 2>&1); then
    echo "$out"
    exit 1
fi
echo "$out" | tail -n 3
# The end-to-end tests run the hiber binary with the layers it preloads beside it
# (libhiber_opencl.so, libhiber_agent.so): cargo test alone does not build those.
cargo build --workspace --locked --quiet
# The test binaries run three at a time, the slowest first (scripts/run_tests.py; one at a
# time with HIBER_TEST_LANES=1); each prints its own "test result" line, and one closing
# line sums them all up.
bins=$(mktemp)
trap 'rm -f "$bins"' EXIT
cargo test --workspace --locked --no-run --message-format=json --quiet >"$bins"
cargo test --workspace --locked --doc --quiet
python3 scripts/run_tests.py "$@" <"$bins"
