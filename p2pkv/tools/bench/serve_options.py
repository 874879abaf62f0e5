"""The settings, flags and systems of ``p2pkv bench serve``.

A system is what the benchmark's client talks to: a proxy in front of a
prefill/decode pair, or one aggregated engine. The p2pkv systems differ only
in the proxy's ``--transfer-mode`` (the direction every decode leg asks for),
so they run on one pair of engines, each behind its own proxy
(:func:`plan_groups`).

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
from collections.abc import Sequence
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class SystemSpec:
    """One system: ``name``; ``label`` (what it is); ``connector`` of its pair (``"p2pkv"``, ``"nixl"``, or
    None for one aggregated engine); ``transfer_mode``, its proxy's ``--transfer-mode`` (``"pull"``: the
    decode engine READs; ``"push"``: the prefill engine WRITEs; ``"stream"``: the prefill engine WRITEs each layer
    as its forward computes it, both legs sent at once; ``""``: the decode engine's setting)."""

    name: str
    label: str
    connector: str | None
    transfer_mode: str = ""


SYSTEM_SPECS: dict[str, SystemSpec] = {spec.name: spec for spec in (
    SystemSpec("p2pkv-pull", "p2pkv P/D pair, decode READs (proxy --transfer-mode pull)", "p2pkv", "pull"),
    SystemSpec("p2pkv-push", "p2pkv P/D pair, prefill WRITEs (proxy --transfer-mode push)", "p2pkv", "push"),
    SystemSpec("p2pkv-stream", "p2pkv P/D pair, layers WRITTEN as computed (proxy --transfer-mode stream)", "p2pkv",
               "stream"),
    SystemSpec("nixl", "NixlConnector P/D pair + proxy", "nixl"),
    SystemSpec("aggregated", "one aggregated engine", None),
    SystemSpec("p2pkv", "p2pkv P/D pair, the decode engine's transfer_mode (auto)", "p2pkv"),
)}
"""Every system this benchmark can run, by name."""

SYSTEMS = tuple(SYSTEM_SPECS)
"""``--systems`` choices."""
DEFAULT_SYSTEMS = ("p2pkv-pull", "p2pkv-push", "nixl", "aggregated")
"""The systems of a run without ``--systems``, in this order."""
EXPECTED_DIRECTION = {n: s.transfer_mode for n, s in SYSTEM_SPECS.items() if s.connector == "p2pkv" and s.transfer_mode}
"""p2pkv system → the direction every one of its transfers must take (``p2pkv:pulls_by_direction_total``)."""


def plan_groups(systems: Sequence[str], share_engines: bool = True) -> list[tuple[str, ...]]:
    """Which systems run on which engines, in run order: one group per set of engines, started once, its
    systems measured back to back. With ``share_engines`` the p2pkv systems share one pair (each behind its
    own proxy) at the place of the first of them; without (prefix caching on), each gets its own."""
    groups: list[tuple[str, ...]] = []
    shared = [n for n in systems if SYSTEM_SPECS[n].connector == "p2pkv"] if share_engines else []
    for name in systems:
        if name not in shared:
            groups.append((name,))
        elif name == shared[0]:
            groups.append(tuple(shared))
    return groups


DATASETS = ("text", "random")
"""``--dataset`` choices (see :class:`ServeBenchOptions`)."""

EXTRA_PROXY_PORT = 600
"""Offset from ``--base-port`` of the first extra proxy in front of shared engines (the next +1, ...)."""


@dataclass
class ServeBenchOptions:
    """Settings of one ``p2pkv bench serve`` run: each field is the flag of the same name (see
    :func:`add_arguments`; ``start_timeout_s`` is ``--start-timeout``, in seconds). Lengths are in tokens;
    ``p2pkv_engines`` is ``(prefill URL, decode URL)`` of a running pair, empty to start one."""

    model: str = ""
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    concurrency: tuple[int, ...] = (1, 2, 4)
    num_prompts: int = 8
    warmup: int = 4
    token_check_prompts: int = 4
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
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup}: must be >= 0")
        if self.token_check_prompts < 0:
            raise ValueError(f"--token-check-prompts {self.token_check_prompts}: must be >= 0")
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
                   help=f"comma-separated, run in this order (default {','.join(d.systems)}; also: p2pkv-stream, "
                        "layers WRITTEN while the prefill runs; p2pkv, the decode engine's own transfer_mode). "
                        "The p2pkv systems share one pair, each behind its own proxy, and run back to back, "
                        "their points interleaved")
    p.add_argument("--concurrency", type=ints, default=d.concurrency,
                   help="max requests in flight, a comma-separated sweep (default 1,2,4)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per point")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="requests of about --input-len sent to each system before its sweep, not measured "
                        "(handshakes, first transfers of the real size; default 4; fewer for long prompts on a "
                        "slow host)")
    p.add_argument("--token-check-prompts", type=int, default=d.token_check_prompts,
                   help="how many of the first point's prompts each system answers again, one by one, for the "
                        "token-id check (default 4; 0: only the answers' texts are compared; each costs a prefill "
                        "per system, minutes for long prompts on a slow host)")
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
    p.add_argument("--start-timeout", dest="start_timeout_s", type=float, default=d.start_timeout_s,
                   help="seconds for engines to start")
    p.add_argument("--p2pkv-engines", default="", metavar="PREFILL_URL,DECODE_URL",
                   help="run the p2pkv systems on this running pair (P2PKV_SECRET: its secret) instead of starting "
                        "one; each system gets its own proxy and its own cache_salt")
    p.add_argument("--aggregated-engine", default="", metavar="URL",
                   help="run the aggregated system on this running engine instead of starting one")
    p.add_argument("--json", metavar="PATH", help="write the run here: per point vLLM's own bench serve result, "
                                                 "p2pkv's numbers under 'p2pkv'")
    p.add_argument("--plot", metavar="NAME.png",
                   help="TTFT/TPOT p50 and the prefill engine's latency vs concurrency, and the handover phases as "
                        "NAME-handover.png (needs matplotlib: p2pkv[bench])")


def options_from_args(args: argparse.Namespace) -> ServeBenchOptions:
    """The options of parsed flags (not validated)."""
    def split(text: str) -> tuple[str, ...]:
        return tuple(x.strip().rstrip("/") for x in text.split(",") if x.strip())

    given = {f.name: getattr(args, f.name) for f in fields(ServeBenchOptions)}
    return ServeBenchOptions(**{**given, "systems": split(args.systems), "concurrency": tuple(args.concurrency),
                                "extra_engine_args": tuple(shlex.split(args.extra_engine_args)),
                                "p2pkv_engines": split(args.p2pkv_engines),
                                "aggregated_engine": args.aggregated_engine.rstrip("/")})
