#!/usr/bin/env bash
# Verified KV under load: a local P/D pair whose decode engine verifies every load (verify_kv), and an
# aggregated engine, answer the same CONCURRENCY requests at once in pull, push and stream mode
# (`p2pkv bench serve`: every answer compared with the aggregated engine's); then the decode engine's
# p2pkv:kv_checks_total by direction and outcome. Writes under OUT (default /tmp/p2pkv-verify-concurrent).
# Usage: bash scripts/bench_verify_concurrent.sh [CONCURRENCY (default 512)]
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=${1:-512}
OUT=${OUT:-/tmp/p2pkv-verify-concurrent}
MODEL=${MODEL:-.p2pkv/tiny-model}
BASE=${BASE_PORT:-18400}
mkdir -p "$OUT"
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
P2PKV_SECRET=$(.venv/bin/python -c "import secrets; print(secrets.token_hex(32))")
export P2PKV_SECRET
[ -d "$MODEL" ] || .venv/bin/p2pkv make-tiny-model "$MODEL"
.venv/bin/p2pkv launch local --model "$MODEL" --proxy-port "$BASE" --prefill-port $((BASE + 1)) \
  --decode-port $((BASE + 2)) --aggregated-port $((BASE + 3)) --side-channel-port $((BASE + 10)) \
  --log-dir "$OUT/logs" --decode-extra-config '{"verify_kv": true}' > "$OUT/launch.log" 2>&1 &
launched=$!
trap 'kill -TERM $launched 2>/dev/null; wait $launched 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$BASE/health" > /dev/null && curl -sf "http://127.0.0.1:$((BASE + 3))/health" > /dev/null; then
    break
  fi
  kill -0 "$launched" 2> /dev/null || { echo "the pair did not start: see $OUT/launch.log" >&2; exit 1; }
  sleep 2
done
rc=0
.venv/bin/p2pkv bench serve --model "$MODEL" --systems p2pkv-pull,p2pkv-push,p2pkv-stream,aggregated \
  --p2pkv-engines "http://127.0.0.1:$((BASE + 1)),http://127.0.0.1:$((BASE + 2))" \
  --aggregated-engine "http://127.0.0.1:$((BASE + 3))" --concurrency "$CONCURRENCY" --num-prompts "$CONCURRENCY" \
  --warmup 1 --input-len 200 --output-len 8 --base-port $((BASE + 100)) --work-dir "$OUT/work" \
  --json "$OUT/result.json" || rc=$?
echo "decode engine's checks (p2pkv:kv_checks_total):"
curl -s "http://127.0.0.1:$((BASE + 2))/metrics" | grep '^p2pkv:kv_checks_total' || echo "(none)"
exit $rc
