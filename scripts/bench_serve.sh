#!/usr/bin/env bash
# Serving benchmark through the bundled proxy: a p2pkv prefill/decode pair,
# a NixlConnector pair and one aggregated engine, each driven by vLLM's
# `bench serve` client over a concurrency sweep, with every answer compared.
# Extra arguments go to `p2pkv bench serve` (see `p2pkv bench serve --help`),
# e.g. --json docs/benchmarks/serve-cpu.json --plot docs/benchmarks/serve-cpu.png
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/p2pkv bench serve "$@"
