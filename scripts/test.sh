#!/usr/bin/env bash
# Sets up .venv if needed, lints, and runs the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k handshake`).
# One process by default. P2PKV_TEST_WORKERS=2 runs two pytest-xdist workers: the modules that start engines
# in one of them (they share the session's engines: tests/conftest.py ENGINE_MODULES), everything else spread
# over both; on 2 cores the in-process timing tests then fail under the engines' load, so it is not the default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
.venv/bin/ruff check p2pkv handshake tests
workers=${P2PKV_TEST_WORKERS:-0}
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest --durations=25 "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --durations=25 "$@"
