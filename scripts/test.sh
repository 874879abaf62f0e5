#!/usr/bin/env bash
# Sets up .venv if needed, lints, and runs the whole test suite in two pytest runs at once, each on its own
# ports (tests/conftest.py port_range): the in-process tests on P2PKV_TEST_WORKERS pytest-xdist workers (2 by
# default, one per core), and the tests marked `engines` in one process at nice 19 (they share the session's
# engines), whose output follows. Extra arguments go to both runs (e.g. `bash scripts/test.sh -k handshake`);
# with `-m` (the caller picks the marks) or P2PKV_TEST_WORKERS=0 one pytest process runs what is asked.
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
engines_log=$(mktemp)
# The engine tests start at once at the lowest priority: their engines start on the CPU the in-process tests
# leave idle (they wait on sockets, timeouts and processes much of the time), and the in-process tests'
# timing sees little of their load (a nice-19 process gets about 1.5 % of a core a nice-0 process wants).
pass env P2PKV_TEST_PORTS=28000-32000 nice -n 19 .venv/bin/python -m pytest -m engines --durations=25 "$@" \
  > "$engines_log" 2>&1 &
engines=$!
echo "== in-process tests ($workers workers; the engine tests start meanwhile at nice 19)"
pass env P2PKV_TEST_PORTS=20000-28000 .venv/bin/python -m pytest -n "$workers" -m "not engines" --durations=25 "$@" \
  || status=$?
echo "== engine tests (one process)"
wait "$engines" || status=$?
cat "$engines_log"
rm -f "$engines_log"
exit "$status"
