#!/usr/bin/env bash
# Sets up .venv if needed, then runs the demo: a local prefill/decode pair
# with p2pkv and the bundled proxy answering real prompts, checked token for
# token against one aggregated engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/p2pkv demo "$@"
