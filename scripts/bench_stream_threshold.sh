#!/usr/bin/env bash
# Where layer streaming stops paying: stream vs one bulk WRITE after the last layer (scripts/bench_transfer.py
# --mode stream) over short to long prompts, with a stand-in forward of US_PER_TOKEN µs per token and layer,
# on each UCX transport of TRANSPORTS. Writes $OUT/$NAME-<transport>-<tokens>.json, then the table and plot
# (scripts/stream_threshold_report.py).
#
#   TOKENS="64 128 256 512 1024 2048" TRANSPORTS="cma tcp" bash scripts/bench_stream_threshold.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
TOKENS=${TOKENS:-"64 128 256 512 1024 2048"}
TRANSPORTS=${TRANSPORTS:-"cma tcp"}
US_PER_TOKEN=${US_PER_TOKEN:-2}
REQUESTS=${REQUESTS:-8}
OUT=${OUT:-docs/benchmarks}
NAME=${NAME:-stream-threshold-cpu}
MODEL="--layers 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --block-size 16"
for transport in $TRANSPORTS; do
  for tokens in $TOKENS; do
    layer_ms=$("$PYTHON" -c "print($tokens * $US_PER_TOKEN / 1000)")
    if [ "$transport" = tcp ]; then tls=(env UCX_TLS=tcp,self); else tls=(env); fi
    "${tls[@]}" UCX_NET_DEVICES=lo "$PYTHON" scripts/bench_transfer.py --mode stream $MODEL --tokens "$tokens" \
      --layer-ms "$layer_ms" --requests "$REQUESTS" --max-mem-gib 4 --quiet \
      --json "$OUT/$NAME-$transport-$tokens.json"
  done
done
"$PYTHON" scripts/stream_threshold_report.py "$OUT" "$NAME"
