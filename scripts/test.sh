#!/usr/bin/env bash
# Sets up .venv if needed, lints, and runs the whole test suite in two passes: the in-process tests on
# P2PKV_TEST_WORKERS pytest-xdist workers (3 by default; no engines run meanwhile, so their timing is the
# machine's alone), then the tests marked `engines` in one process (they share the session's engines:
# tests/conftest.py). Extra arguments go to both passes (e.g. `bash scripts/test.sh -k handshake`); with
# `-m` (the caller picks the marks) or P2PKV_TEST_WORKERS=0 one pytest process runs what is asked.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
.venv/bin/ruff check p2pkv handshake tests
workers=${P2PKV_TEST_WORKERS:-3}
for arg in "$@"; do
  case "$arg" in -m|-m*) workers=0 ;; esac  # the caller picks the marks: one pass, as asked
done
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest --durations=25 "$@"
fi
# pytest exits 5 when a pass selects no test (arguments naming only one kind): that pass is not a failure.
pass() { "$@" || { rc=$?; [ "$rc" = "5" ] || return "$rc"; }; }
status=0
echo "== in-process tests ($workers workers)"
pass .venv/bin/python -m pytest -n "$workers" -m "not engines" --durations=25 "$@" || status=$?
echo "== engine tests (one process)"
pass .venv/bin/python -m pytest -m engines --durations=25 "$@" || status=$?
exit "$status"
