#!/usr/bin/env bash
# Sets up .venv if needed, lints, and runs the whole test suite in two pytest runs, each on its own ports
# (tests/conftest.py port_range): the in-process tests on P2PKV_TEST_WORKERS pytest-xdist workers (2 by
# default, one per core), then the tests marked `engines` in one process (they share the session's engines).
# Running both at once (the engine run at nice 19) was faster but made the in-process tests' timing fail
# under the load of vLLM's worker processes. Extra arguments go to both runs (e.g. `bash scripts/test.sh -k
# handshake`); with `-m` (the caller picks the marks) or P2PKV_TEST_WORKERS=0 one pytest process runs what
# is asked.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
.venv/bin/ruff check p2pkv handshake tests
workers=${P2PKV_TEST_WORKERS:-2}
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
pass env P2PKV_TEST_PORTS=20000-28000 .venv/bin/python -m pytest -n "$workers" -m "not engines" --durations=25 "$@" \
  || status=$?
echo "== engine tests (one process)"
pass env P2PKV_TEST_PORTS=28000-32000 .venv/bin/python -m pytest -m engines --durations=25 "$@" || status=$?
exit "$status"
