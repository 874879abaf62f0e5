"""What ``transfer_mode: auto`` picks for a GPU memory pair on this host, and whether UCX's cuda_ipc GET helps.

Runs ``p2pkv doctor``'s VRAM pair (:func:`p2pkv.tools.doctor_pair.pair_transfers`:
one process READs a child's GPU buffer, then the child WRITEs it back) once
with UCX as configured and once with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on``
(each in a fresh child process, since UCX reads its settings at start), feeds
each READ's :class:`~p2pkv.dataplane.transport.TransportReport` to the decode
side's :class:`~p2pkv.decode.direction.Directions` under ``auto`` (its log line
is printed as the connector prints it), and writes one JSON object::

    {"runs": [{"env": {...}, "nbytes": int, "read": {...report, "seconds", "gbps", "bytes_ok"},
               "write": {...}, "auto": {"direction": "pull"|"push", "reason": str}}, ...]}

Usage: ``python scripts/gpu_auto_choice.py --json PATH [--mib 256] [--mem-type DRAM]``. ``VRAM``
(the default) needs a CUDA device (exits 2 without one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys

ZCOPY_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
"""The UCX setting that may make cuda_ipc serve GETs (READs) without NVLink."""


def one_run(nbytes: int, mem_type: str = "VRAM") -> dict:
    """One pair of ``mem_type`` memory in this process (UCX settings from the environment), as written to JSON."""
    from p2pkv.decode.direction import Directions
    from p2pkv.tools.doctor_pair import pair_transfers

    result = pair_transfers(mem_type, nbytes=nbytes)
    directions = Directions("auto")
    directions.on_transport(result.report)
    choice = directions.choices[result.report.peer]

    def side(report, seconds: float, ok: bool) -> dict:
        return {**dataclasses.asdict(report), "seconds": seconds, "gbps": nbytes / seconds / 1e9, "bytes_ok": ok}

    return {"env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("UCX_")}, "nbytes": nbytes,
            "read": side(result.report, result.seconds, result.bytes_ok),
            "write": side(result.write_report, result.write_seconds, result.write_bytes_ok),
            "auto": {"direction": choice.direction.value, "reason": choice.reason}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where to write the runs")
    p.add_argument("--mib", type=int, default=256, help="bytes of each xfer, MiB")
    p.add_argument("--mem-type", choices=["VRAM", "DRAM"], default="VRAM",
                   help="DRAM: the same runs in host memory (a dry run without a GPU)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child: one run, JSON on stdout
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.one:
        print(json.dumps(one_run(args.mib << 20, args.mem_type)), flush=True)
        return 0
    import torch

    if args.mem_type == "VRAM" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    runs = []
    for extra in ({}, ZCOPY_ENV):
        cmd = [sys.executable, __file__, "--one", "--json", "-", "--mib", str(args.mib), "--mem-type", args.mem_type]
        out = subprocess.run(cmd, env={**os.environ, **extra}, capture_output=True, text=True, timeout=180)
        sys.stderr.write(out.stderr)
        if out.returncode != 0:
            runs.append({"env": extra, "error": out.stderr[-2000:]})
            continue
        run = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append(run)
        print(f"{extra or 'UCX defaults'}: READ {run['read']['transport']} ({run['read']['protocol']}) "
              f"{run['read']['gbps']:.1f} GB/s, WRITE {run['write']['transport']} ({run['write']['protocol']}) "
              f"{run['write']['gbps']:.1f} GB/s; auto → {run['auto']['direction']}: {run['auto']['reason']}")
    with open(args.json, "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
