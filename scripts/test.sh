#!/usr/bin/env bash
# Sets up .venv if needed, lints, and runs the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k handshake`).
# Two pytest-xdist workers: the modules that start engines run in one of them (they share the session's
# engines: tests/conftest.py ENGINE_MODULES), everything else is spread over both; P2PKV_TEST_WORKERS=0 runs
# in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
.venv/bin/ruff check p2pkv handshake tests
workers=${P2PKV_TEST_WORKERS:-2}
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest --durations=25 "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --durations=25 "$@"
