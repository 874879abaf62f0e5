"""The settings and flags of ``p2pkv bench serve``.

Ports (``--base-port`` BASE): the first proxy BASE, prefill BASE+100, decode
BASE+200, aggregated BASE+300, side channels BASE+400 (prefill) and BASE+500
(decode); the p2pkv systems that share one pair put their second and third
proxy on BASE+600 and BASE+601.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
from dataclasses import dataclass, field

from p2pkv.tools.bench.serve_systems import DEFAULT_SYSTEMS, SYSTEMS

DATASETS = ("text", "random")
"""``--dataset`` choices (see :class:`ServeBenchOptions`)."""

EXTRA_PROXY_PORT = 600
"""Offset from ``--base-port`` of the first extra proxy in front of shared engines (the next +1, ...)."""


@dataclass
class ServeBenchOptions:
    """Settings of one ``p2pkv bench serve`` run.

    Attributes:
        model: model directory ("" : make the tiny random-weight model in ``work_dir``).
        systems: which of :data:`~p2pkv.tools.bench.serve_systems.SYSTEMS` to
            run, in this order (the p2pkv systems, sharing one pair, run back
            to back at the place of the first of them).
        concurrency: ``--max-concurrency`` values of the sweep (requests in flight).
        num_prompts: requests per point.
        input_len / output_len: prompt and generated tokens per request.
        block_size: tokens per KV block.
        dtype: model dtype.
        seed: dataset seed of the first point; point *i* uses ``seed + i``.
        base_port: first of the ports (see the module docstring).
        host: address everything binds to.
        work_dir: tiny model, engine logs, vLLM's per-point result files.
        tensor_parallel_size: TP size of every engine.
        extra_engine_args: more ``vllm serve`` flags for every engine.
        prefix_caching: leave vLLM's prefix caching on (then every p2pkv
            system gets its own pair: shared engines would serve the second
            system's prompts from the first one's cache).
        first_token_from: the proxy's ``--first-token-from`` (``prefill`` or ``decode``).
        dataset: ``text`` (readable random ASCII prompts of ``input_len``
            characters, :func:`~p2pkv.tools.bench.serve_client.write_text_prompts`)
            or ``random`` (vLLM's random token ids).
        prefill_probe: during every point of a P/D pair, send the prefill
            engine requests of its own, one at a time, and measure their TTFT
            and TPOT (:class:`~p2pkv.tools.bench.serve_results.ProbeResult`).
        start_timeout_s: how long engines may take to become healthy (seconds).
        p2pkv_engines: ``(prefill URL, decode URL)`` of a p2pkv pair already running (e.g. ``p2pkv launch
            local``'s, with ``P2PKV_SECRET`` set to its secret): the p2pkv systems run there, each behind a
            proxy of its own, instead of on a pair the bench starts. Empty: start one.
        aggregated_engine: URL of a plain engine already running for the ``aggregated`` system ("": start one).
    """

    model: str = ""
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    concurrency: tuple[int, ...] = (1, 2, 4)
    num_prompts: int = 8
    input_len: int = 256
    output_len: int = 32
    block_size: int = 32
    dtype: str = "float32"
    seed: int = 0
    base_port: int = 8800
    host: str = "127.0.0.1"
    work_dir: str = ".p2pkv/bench-serve"
    tensor_parallel_size: int = 1
    extra_engine_args: tuple[str, ...] = field(default_factory=tuple)
    prefix_caching: bool = False
    first_token_from: str = "prefill"
    dataset: str = "text"
    prefill_probe: bool = False
    start_timeout_s: float = 900.0
    p2pkv_engines: tuple[str, ...] = ()
    aggregated_engine: str = ""

    def validate(self) -> None:
        """Raises ValueError naming the bad flag."""
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad or not self.systems or len(set(self.systems)) != len(self.systems):
            raise ValueError(f"--systems {','.join(self.systems)}: each at most once, from {','.join(SYSTEMS)}")
        if not self.concurrency or min(self.concurrency) < 1 or len(set(self.concurrency)) != len(self.concurrency):
            raise ValueError(f"--concurrency {self.concurrency}: distinct positive integers")
        for flag, v in (("--num-prompts", self.num_prompts), ("--input-len", self.input_len),
                        ("--output-len", self.output_len), ("--block-size", self.block_size)):
            if v < 1:
                raise ValueError(f"{flag} {v}: must be >= 1")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset {self.dataset}: choose from {', '.join(DATASETS)}")
        if self.dataset == "text" and importlib.util.find_spec("pandas") is None:
            raise ValueError("--dataset text: vLLM's client reads the prompts with pandas, which is not installed "
                             "(pip install 'p2pkv[bench]'), or pass --dataset random")
        if self.first_token_from not in ("prefill", "decode"):
            raise ValueError(f"--first-token-from {self.first_token_from}: choose prefill or decode")
        if self.p2pkv_engines and len(self.p2pkv_engines) != 2:
            raise ValueError(f"--p2pkv-engines {','.join(self.p2pkv_engines)}: give PREFILL_URL,DECODE_URL")
        if self.p2pkv_engines and not os.environ.get("P2PKV_SECRET"):
            raise ValueError("--p2pkv-engines: set P2PKV_SECRET to the running pair's secret (its proxies need it)")

    def engine_args(self) -> tuple[str, ...]:
        """Extra ``vllm serve`` flags of every engine."""
        return (() if self.prefix_caching else ("--no-enable-prefix-caching",)) + tuple(self.extra_engine_args)

    def seeds(self) -> dict[int, int]:
        """Concurrency → the dataset seed of its point (``seed + i`` for the *i*-th)."""
        return {c: self.seed + i for i, c in enumerate(self.concurrency)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``p2pkv bench serve``."""
    d = ServeBenchOptions()

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",") if x.strip())

    p.add_argument("--model", default="", help="model directory (default: the tiny random-weight model, "
                                               "made in the work dir)")
    p.add_argument("--systems", default=",".join(d.systems),
                   help=f"comma-separated, run in this order (default {','.join(d.systems)}; also: p2pkv, the "
                        "decode engine's own transfer_mode). The p2pkv systems share one pair, each behind its "
                        "own proxy, and run back to back, their points interleaved")
    p.add_argument("--concurrency", type=ints, default=d.concurrency,
                   help="max requests in flight, a comma-separated sweep (default 1,2,4)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per point")
    p.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=d.output_len, help="generated tokens per request")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--dtype", default=d.dtype, help="model dtype")
    p.add_argument("--seed", type=int, default=d.seed, help="dataset seed of the first point (+1 per point)")
    p.add_argument("--base-port", type=int, default=d.base_port,
                   help="proxy port; prefill, decode, aggregated +100/+200/+300, side channels +400/+500, "
                        "further proxies of shared engines +600, +601")
    p.add_argument("--host", default=d.host, help="address everything binds to")
    p.add_argument("--work-dir", default=d.work_dir, help="tiny model, engine and client logs, vLLM result files")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size, help="TP size of every engine")
    p.add_argument("--extra-engine-args", default="",
                   help="more `vllm serve` flags for every engine, one shell-quoted string")
    p.add_argument("--prefix-caching", action="store_true",
                   help="leave vLLM's prefix caching on (default off: every request's KV is moved in full); each "
                        "p2pkv system then gets its own pair")
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="prompts: 'text' (default: readable random ASCII, --input-len characters) or 'random' "
                        "(vLLM's random token ids; byte soup with a byte-level tokenizer)")
    p.add_argument("--first-token-from", choices=("prefill", "decode"), default=d.first_token_from,
                   help="the proxy's --first-token-from: a streaming request's first token from the prefill "
                        "engine's answer (default) or from the decode engine")
    p.add_argument("--prefill-probe", action="store_true",
                   help="during every point of a P/D pair, also send the prefill engine its own requests (one at "
                        "a time, --input-len characters, --output-len tokens, streamed) and report their TTFT and "
                        "TPOT: whether the traffic, a push in particular, slows the prefill engine")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout_s, help="seconds for engines to start")
    p.add_argument("--p2pkv-engines", default="", metavar="PREFILL_URL,DECODE_URL",
                   help="run the p2pkv systems on this running pair (P2PKV_SECRET: its secret) instead of starting "
                        "one; each system gets its own proxy and its own cache_salt")
    p.add_argument("--aggregated-engine", default="", metavar="URL",
                   help="run the aggregated system on this running engine instead of starting one")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--plot", metavar="PNG", help="TTFT/TPOT p50 vs concurrency (needs matplotlib: p2pkv[bench])")


def options_from_args(args: argparse.Namespace) -> ServeBenchOptions:
    """The options of parsed flags (not validated)."""
    return ServeBenchOptions(
        model=args.model, systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
        concurrency=tuple(args.concurrency), num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, block_size=args.block_size, dtype=args.dtype, seed=args.seed,
        base_port=args.base_port, host=args.host, work_dir=args.work_dir,
        tensor_parallel_size=args.tensor_parallel_size, extra_engine_args=tuple(shlex.split(args.extra_engine_args)),
        prefix_caching=args.prefix_caching, first_token_from=args.first_token_from, dataset=args.dataset,
        prefill_probe=args.prefill_probe, start_timeout_s=args.start_timeout,
        p2pkv_engines=tuple(u.strip().rstrip("/") for u in args.p2pkv_engines.split(",") if u.strip()),
        aggregated_engine=args.aggregated_engine.rstrip("/"))
