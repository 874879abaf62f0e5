#!/usr/bin/env bash
# Starts a local prefill/decode pair with p2pkv plus the bundled proxy and
# keeps them running until Ctrl-C. MODEL defaults to the tiny test model
# (made on first use). Extra arguments go to `p2pkv launch local`
# (see `p2pkv launch local --help`: ports, block size, dtype, log dir).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${MODEL:-.p2pkv/tiny-model}
if [ ! -d "$MODEL" ]; then
  .venv/bin/p2pkv make-tiny-model "$MODEL"
fi
exec .venv/bin/p2pkv launch local --model "$MODEL" "$@"
