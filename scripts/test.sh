#!/usr/bin/env bash
# Sets up .venv if needed, lints, and runs the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k handshake`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
.venv/bin/ruff check p2pkv handshake tests
exec .venv/bin/python -m pytest "$@"
