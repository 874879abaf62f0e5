#!/usr/bin/env bash
# Fetch, into .whl/, the wheels scripts/gpu-check.sh installs on a CUDA machine that reaches no registry:
# p2pkv's own dependencies that such a machine's image (torch, pytest, Triton already there) lacks.
#
#   bash scripts/gpu-wheels.sh [PYTHON_VERSION]     # default 3.12; about 31 MiB
#
# nixl-cu13's expert-parallel libraries (nixl_ep_cu13, ~90 MiB unpacked, unused by p2pkv) are left out of its
# wheel so that the wheels travel in a small upload; its RECORD drops them too.
set -euo pipefail
PYV=${1:-3.12}
DEST=.whl
mkdir -p "$DEST"
NIXL=$(python3 -c "import importlib.metadata as m; print(m.version('nixl'))" 2>/dev/null || echo 1.5.1)
for spec in "nixl==$NIXL" "nixl-cu13==$NIXL" "msgspec" "pyzmq"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "$spec"
done
python3 - "$DEST" <<'EOF'
import glob, os, sys, zipfile

for src in glob.glob(os.path.join(sys.argv[1], "nixl_cu13-*.whl")):
    tmp = src + ".tmp"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith("nixl_ep_cu13/"):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(True) if not line.startswith(b"nixl_ep_cu13/"))
            zout.writestr(info, data)
    os.replace(tmp, src)
EOF
du -sh "$DEST"
