#!/usr/bin/env bash
# p2pkv on one CUDA GPU, in one run of about 5 minutes: GPU memory moved by NIXL in both directions.
#
#   bash scripts/gpu-check.sh            # results under $OUT (default ./gpu-check-out)
#   DEVICE=cpu TOKENS=256,1k bash scripts/gpu-check.sh   # a dry run of every step on a machine without a GPU
#   STEPS=stream,stream-tcp,tests bash scripts/gpu-check.sh   # only the steps named
#
# Needs python3 with torch (CUDA) and pytest. Wheels in .whl/ (nixl, nixl-cu13, msgspec, pyzmq for
# this python) are installed first to /tmp/site when present: a machine with no registry gets p2pkv's
# dependencies that way (`bash scripts/gpu-wheels.sh` fetches them).
#
# Writes, in this order (each step has its own time limit, so one hang does not cost the rest):
#   log.txt                 every step's output
#   auto.json               scripts/gpu_auto_choice.py: the VRAM pair's READ/WRITE transports, with UCX's
#                           defaults and with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on, and what transfer_mode auto picks
#   transfer.json           scripts/bench_transfer.py --device "$DEVICE" --mode pull,push, Llama-3-8B-shaped caches, 1k/4k/16k
#   transfer-getzcopy.json  the same pulls with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on (4k/16k)
#   fixup.json              scripts/bench_fixup.py --device "$DEVICE" (torch, runs, triton)
#   doctor.json             p2pkv doctor --json
#   stream.json             --mode stream: each layer WRITTEN as a stand-in forward (one GEMM of a Llama-3-8B
#                           layer's FLOPs per layer on a GPU, LAYER_MS ms per layer on the CPU) computes it,
#                           against one WRITE after the last layer; STREAM_TOKENS (1k/4k/8k)
#   stream-inline.json      the same with --poster inline: the forward's own thread posts the WRITEs
#   stream-tcp.json         the same (poster thread) over UCX's tcp transport only (a link slower than the forward), 1k/4k
#   stream-matched-N.json   over tcp only, the stand-in forward a sleep kernel as long per layer as the link takes to
#                           move a layer (MATCHED, tokens:ms pairs; 1k/4k/8k by default): the link-bound regime where
#                           a layer's WRITE can hide behind the next layer's forward
#                           (FORWARD_STREAM=side: the forward on a non-blocking CUDA stream, not torch's current one)
#   tests.log               pytest -m gpu
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
TOKENS=${TOKENS:-1024,4k,16k}
BIG=${TOKENS#*,}  # the GET_ZCOPY pulls: all but the smallest size

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || { echo "installing .whl/ failed" | tee -a "$LOG"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

step() {  # step NAME SECONDS COMMAND...: run with a limit, log its output and time
  local name=$1 limit=$2; shift 2
  if [[ -n ${STEPS:-} && ",$STEPS," != *",$name,"* ]]; then return; fi
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" >>"$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
}

step env 60 bash -c "nvidia-smi; nvidia-smi topo -m; $PY -c 'import torch, nixl, sys; print(sys.version); \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)); print(nixl.__file__)'; \
$PY -c 'from p2pkv.dataplane.transport import ucx_version; print(\"UCX\", ucx_version())'"
step auto 150 $PY scripts/gpu_auto_choice.py --json "$OUT/auto.json" --mib 256
LLAMA8B=(--layers 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --block-size 16)
step transfer 240 $PY scripts/bench_transfer.py --device "$DEVICE" --mode pull,push "${LLAMA8B[@]}" \
  --tokens "$TOKENS" --requests 4 --max-mem-gib 24 --json "$OUT/transfer.json"
step transfer-getzcopy 120 env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on $PY scripts/bench_transfer.py \
  --device "$DEVICE" --mode pull "${LLAMA8B[@]}" --tokens "$BIG" --requests 4 --max-mem-gib 24 \
  --json "$OUT/transfer-getzcopy.json"
step fixup 120 $PY scripts/bench_fixup.py --device "$DEVICE" --json "$OUT/fixup.json"
step doctor 120 bash -c "$PY -m p2pkv.tools.cli doctor --json > '$OUT/doctor.json'"
if [[ $DEVICE == cpu ]]; then LAYER_MS=${LAYER_MS:-2}; else LAYER_MS=${LAYER_MS:-0}; fi
STREAM_TOKENS=${STREAM_TOKENS:-1024,4k,8k}
step stream 150 $PY scripts/bench_transfer.py --device "$DEVICE" --mode stream "${LLAMA8B[@]}" --tokens "$STREAM_TOKENS" \
  --layer-ms "$LAYER_MS" --requests 5 --max-mem-gib 24 --json "$OUT/stream.json"
step stream-inline 150 $PY scripts/bench_transfer.py --device "$DEVICE" --mode stream "${LLAMA8B[@]}" \
  --tokens "$STREAM_TOKENS" --layer-ms "$LAYER_MS" --poster inline --requests 5 --max-mem-gib 24 \
  --json "$OUT/stream-inline.json"
step stream-tcp 200 env UCX_TLS=tcp,cuda_copy,self $PY scripts/bench_transfer.py --device "$DEVICE" --mode stream \
  "${LLAMA8B[@]}" --tokens "${STREAM_TOKENS%,*}" --layer-ms "$LAYER_MS" --requests 3 --max-mem-gib 24 \
  --json "$OUT/stream-tcp.json"
MATCHED=${MATCHED:-1024:12,4096:45,8192:90}
for pair in ${MATCHED//,/ }; do
  step stream-matched 150 env UCX_TLS=tcp,cuda_copy,self $PY scripts/bench_transfer.py --device "$DEVICE" --mode stream \
    "${LLAMA8B[@]}" --tokens "${pair%%:*}" --layer-ms "${pair#*:}" --requests 3 --max-mem-gib 24 \
    --forward-stream "${FORWARD_STREAM:-current}" --json "$OUT/stream-matched-${pair%%:*}.json"
done
step tests 240 bash -c "$PY -m pytest -m gpu -p no:cacheprovider -q -rA -o addopts= tests/test_hetero.py \
  tests/test_pipeline_stages.py tests/test_doctor.py tests/test_transport.py tests/test_bench_transfer.py tests/test_fixup.py \
  tests/test_streamer.py > '$OUT/tests.log' 2>&1"
tail -n 3 "$OUT/tests.log"
