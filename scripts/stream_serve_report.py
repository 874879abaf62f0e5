"""The table and plot of scripts/bench_stream.sh: stream, push, pull and one engine, per transport and prompt length.

    python scripts/stream_serve_report.py docs/benchmarks/stream-serve-cpu-*.json \
        --plot docs/benchmarks/stream-serve-cpu.png

Reads the ``p2pkv bench serve`` JSON files the script wrote (one per transport and prompt length, named
``stream-serve-cpu-<transport>-<tokens>.json``) and prints, per file and system: TTFT p50, p90 (``-`` for runs
stored before p90 was) and p99 (ms), the prefill legs' mean (ms: the prefill engine's own time for the prompt,
as the proxy saw it), TTFT minus that (ms: what the P/D split adds after the prefill, the transfer's wait
included), the decode engine's transfers (mean ms, from its ask to the KV landed: for a stream that spans the
whole prefill) and, for streams, the wait after the prefill's last layer (the prefill engine's
``p2pkv:stream_tail_seconds`` mean, ms, and in layers: over one layer's transfer, bulk push's transfer time over
``--layers``), how its streams went (``per_layer``/``whole`` counts: a WRITE per layer, or one WRITE after the
last layer by the link rule), its TTFT p50 over max(its prefill leg, push's transfer) and its prefill leg over
push's (the issue's goals: at most 1.15 and a drop of at most 5 %).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from p2pkv.tools.bench.plotting import pyplot, save

SYSTEMS = ("p2pkv-stream", "p2pkv-push", "p2pkv-pull", "aggregated")
LAYERS = 32
"""The benchmark model's layers (scripts/bench_stream.sh)."""


def rows(path: Path, layers: int = LAYERS) -> list[dict[str, Any]]:
    """One row per system of one run's JSON (its first point); a stream's wait after the last layer also in
    layers of bulk push's transfer (``layers`` layers) when both were measured."""
    doc = json.loads(path.read_text())
    match = re.search(r"-(\w+)-(\d+)\.json$", path.name)
    transport, tokens = (match.group(1), int(match.group(2))) if match else ("?", 0)
    out = []
    for name in SYSTEMS:
        points = doc["systems"].get(name, {}).get("points") or []
        if not points:
            continue
        p = points[0]
        extra = p.get("p2pkv") or {}
        prefill = ((extra.get("prefill") or {}).get("legs") or {}).get("mean_ms")
        transfer = (extra.get("transfers") or {}).get("mean_ms")
        streamed = name == "p2pkv-stream"
        tail = ((extra.get("prefill") or {}).get("stream_tail") or {}).get("mean_ms") if streamed else None
        how = ((extra.get("prefill") or {}).get("streams") or {}) if streamed else {}
        out.append({"transport": transport, "tokens": tokens, "system": name, "ttft_p50": p["p50_ttft_ms"],
                    "ttft_p90": p.get("p90_ttft_ms"), "ttft_p99": p["p99_ttft_ms"], "prefill_ms": prefill,
                    "transfer_ms": transfer,
                    "after_prefill_ms": p["mean_ttft_ms"] - prefill if prefill is not None else None,
                    "tail_ms": tail, "tail_layers": None, "how": how, "ttft_ratio": None, "prefill_ratio": None})
    push_row = next((r for r in out if r["system"] == "p2pkv-push"), None)
    push = push_row["transfer_ms"] if push_row else None
    for r in out:
        if r["tail_ms"] is not None and push:
            r["tail_layers"] = r["tail_ms"] / (push / layers)
        if r["system"] == "p2pkv-stream" and push and r["prefill_ms"]:
            r["ttft_ratio"] = r["ttft_p50"] / max(r["prefill_ms"], push)
            r["prefill_ratio"] = r["prefill_ms"] / push_row["prefill_ms"] if push_row["prefill_ms"] else None
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(all_rows: list[dict[str, Any]]) -> str:
    lines = ["| transport | prompt tokens | system | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | prefill leg ms | "
             "TTFT - prefill ms | transfer ms | wait after last layer ms (layers) | streams per layer / whole | "
             "TTFT p50 / max(prefill, push transfer) | prefill leg / push's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in all_rows:
        tail = _ms(r["tail_ms"]) + (f" ({r['tail_layers']:.2f})" if r["tail_layers"] is not None else "")
        how = f"{r['how'].get('per_layer', 0)} / {r['how'].get('whole', 0)}" if r["how"] else "-"
        lines.append(f"| {r['transport']} | {r['tokens']} | {r['system']} | {_ms(r['ttft_p50'])} | "
                     f"{_ms(r['ttft_p90'])} | {_ms(r['ttft_p99'])} | {_ms(r['prefill_ms'])} | "
                     f"{_ms(r['after_prefill_ms'])} | {_ms(r['transfer_ms'])} | {tail} | {how} | "
                     f"{_ratio(r['ttft_ratio'])} | {_ratio(r['prefill_ratio'])} |")
    return "\n".join(lines)


def plot(all_rows: list[dict[str, Any]], path: str) -> None:
    plt = pyplot("stream_serve_report")
    if plt is None:
        return
    groups = sorted({(r["transport"], r["tokens"]) for r in all_rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(SYSTEMS)
    for i, name in enumerate(SYSTEMS):
        ys = [next((r["ttft_p50"] / 1000 for r in all_rows if (r["transport"], r["tokens"]) == g
                    and r["system"] == name), 0.0) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], ys, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], [f"{t}\n{n} tokens" for t, n in groups])
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("32-layer model, Llama-3-8B-shaped KV, CPU engines (scripts/bench_stream.sh)")
    ax.legend()
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--layers", type=int, default=LAYERS, help="the model's layers (default %(default)s)")
    args = parser.parse_args()
    all_rows = [r for f in sorted(args.files, key=lambda p: (rows(p)[0]["transport"], rows(p)[0]["tokens"]))
                for r in rows(f, args.layers)]
    print(table(all_rows))
    if args.plot:
        plot(all_rows, args.plot)


if __name__ == "__main__":
    main()
