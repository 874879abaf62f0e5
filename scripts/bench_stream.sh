#!/usr/bin/env bash
# Layer-streamed transfer against bulk push, pull and one aggregated engine, on real CPU engines, in one run:
# a 32-layer random-weight Llama with Llama-3-8B-shaped KV (8 KV heads x head_dim 128), for each UCX transport
# (cma: shared-memory copies; tcp: loopback TCP, the link-bound case) one `p2pkv launch local` pair + aggregated
# engine, and for each prompt length one `p2pkv bench serve` over the four systems on those engines.
#
#   bash scripts/bench_stream.sh                      # results in docs/benchmarks/stream-serve-cpu-*.json
#   LENGTHS=1024 TRANSPORTS=cma PROMPTS=2 bash scripts/bench_stream.sh   # a short try
#
# Environment: LENGTHS (prompt tokens, default "1024 2048 4096"), TRANSPORTS ("cma tcp"), PROMPTS (requests per
# point, 4), WARMUP (unmeasured requests per system first, 4), TOKEN_CHECKS (prompts each system answers again for
# the token-id check, 4; 0: texts only), OUTPUT (generated tokens, 8), OUT (docs/benchmarks), NAME (file prefix, stream-serve-cpu), WORK
# (.p2pkv/bench-stream), BASE_PORT (9100), PIN ("prefill-cores decode-cores aggregated-cores", e.g. "0 1 0": once
# the engines serve, every thread of each engine's processes is pinned to its cores with `taskset`, so that on one
# host the decode engine's receiving does not share the prefill forward's cores; empty: no pinning).
# The table and plot: scripts/stream_serve_report.py, run at the end.
# A link-bound run: rate-limit UCX's TCP first (scripts/limit_ucx_tcp.sh, root) and pass its port range, e.g.
#   UCX_TCP_PORT_RANGE=40960-41983 TRANSPORTS=tcp NAME=stream-serve-cpu-limited bash scripts/bench_stream.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LENGTHS=${LENGTHS:-1024 2048 4096}
TRANSPORTS=${TRANSPORTS:-cma tcp}
PROMPTS=${PROMPTS:-4}
WARMUP=${WARMUP:-4}
TOKEN_CHECKS=${TOKEN_CHECKS:-4}
OUTPUT=${OUTPUT:-8}
OUT=${OUT:-docs/benchmarks}
NAME=${NAME:-stream-serve-cpu}
WORK=${WORK:-.p2pkv/bench-stream}
B=${BASE_PORT:-9100}
PIN=${PIN:-}
if [[ -n $PIN ]]; then
  read -r PIN_PREFILL PIN_DECODE PIN_AGGREGATED <<<"$PIN"
  [[ -n ${PIN_AGGREGATED:-} ]] || { echo "PIN: three core lists (prefill decode aggregated), not '$PIN'" >&2; exit 2; }
fi
mkdir -p "$WORK" "$OUT"
MODEL=$(cd "$WORK" && pwd)/llama-32l-kv8x128
$PY -m p2pkv.tools.cli make-tiny-model "$MODEL" --layers 32 --hidden-size 1024 --heads 8 --kv-heads 8 \
  --intermediate-size 256 --max-position-embeddings 16384 >/dev/null
export P2PKV_SECRET=${P2PKV_SECRET:-$($PY -c "import secrets; print(secrets.token_hex(16))")}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} UCX_NET_DEVICES=lo
LAUNCH_PID=
stop() { [[ -n $LAUNCH_PID ]] && kill -TERM "$LAUNCH_PID" 2>/dev/null && wait "$LAUNCH_PID" || true; LAUNCH_PID=; }
trap stop EXIT
# pids of process $1 and of all its descendants
tree() { echo "$1"; for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do tree "$c"; done; }
# pin every thread of the engine serving on port $1 (its API server and its children) to cores $2
pin() {
  local root
  root=$(pgrep -f "api_server.*--port $1( |\$)" | head -1)
  [[ -n $root ]] || { echo "PIN: no engine serves port $1" >&2; exit 1; }
  for p in $(tree "$root"); do taskset -a -cp "$2" "$p" >/dev/null; done
  echo "pinned the engine on port $1 (pid $root and its children) to cores $2"
}

for transport in $TRANSPORTS; do
  case $transport in
    cma) export UCX_TLS=cma,tcp,self ;;   # host memory moves by cma; control messages over tcp
    tcp) export UCX_TLS=tcp,self ;;       # every byte over loopback TCP
    *) echo "TRANSPORTS: cma or tcp, not $transport" >&2; exit 2 ;;
  esac
  logs=$WORK/logs-$transport
  $PY -m p2pkv.tools.cli launch local --model "$MODEL" --proxy-port $B --prefill-port $((B + 1)) \
    --decode-port $((B + 2)) --aggregated-port $((B + 3)) --side-channel-port $((B + 10)) --block-size 32 \
    --max-model-len 8448 --log-dir "$logs" >"$WORK/launch-$transport.log" 2>&1 &
  LAUNCH_PID=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$B/health" >/dev/null && break
    kill -0 "$LAUNCH_PID" 2>/dev/null || { echo "launch local died: $WORK/launch-$transport.log" >&2; exit 1; }
    sleep 1
  done
  if [[ -n $PIN ]]; then
    pin $((B + 1)) "$PIN_PREFILL"; pin $((B + 2)) "$PIN_DECODE"; pin $((B + 3)) "$PIN_AGGREGATED"
  fi
  for len in $LENGTHS; do
    echo "== $transport, $len-token prompts"
    $PY -m p2pkv.tools.cli bench serve --model "$MODEL" --systems p2pkv-stream,p2pkv-push,p2pkv-pull,aggregated \
      --p2pkv-engines "http://127.0.0.1:$((B + 1)),http://127.0.0.1:$((B + 2))" \
      --aggregated-engine "http://127.0.0.1:$((B + 3))" --base-port $((B + 20)) --dataset random \
      --input-len "$len" --output-len "$OUTPUT" --num-prompts "$PROMPTS" --warmup "$WARMUP" --concurrency 1 --block-size 32 \
      --token-check-prompts "$TOKEN_CHECKS" \
      --work-dir "$WORK/serve-$transport-$len" --json "$OUT/$NAME-$transport-$len.json"
  done
  stop
done
files=()
for transport in $TRANSPORTS; do for len in $LENGTHS; do files+=("$OUT/$NAME-$transport-$len.json"); done; done
$PY scripts/stream_serve_report.py "${files[@]}" --plot "$OUT/$NAME.png" | tee "$OUT/$NAME-table.md"
