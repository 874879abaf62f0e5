"""End to end with engines of different block sizes and TP sizes: real vLLM engines, p2pkv on all.

Three engines run p2pkv in ``kv_both`` mode, so each can prefill for the
others (the shared pair's prefill engine and two started here): TP 1
with 32-token blocks, TP 1 with 64-token blocks (vLLM's CPU attention needs
multiples of 32) and TP 2 with 32-token blocks. Rows:
block 32 → 64 (prefill block smaller), block 64 → 32 (prefill block
larger, which vLLM's own NixlConnector does not support), TP 2 → 1,
TP 1 → 2, and TP 2 block 32 → TP 1 block 64. The decoded tokens must
equal what the prefill engine produces on its own for the same prompt,
and every prefill rank must free its blocks. Every row runs in both
transfer modes: pull (the decode ranks READ) and push (the prefill ranks
WRITE into the decode ranks' blocks, or into their staging when a fixup
follows).
"""

from __future__ import annotations

import httpx
import pytest

from p2pkv.tools.demo import (
    LOGPROB_TOLERANCE,
    complete,
    max_logprob_diff,
    read_pull_stats,
    wait_blocks_released,
)
from p2pkv.tools.deploy.engines import EngineSpec, start_engine
from p2pkv.tools.deploy.processes import stop_children, wait_healthy
from tests.conftest import MODES, free_ports
from tests.legs import prefill_then_decode

pytestmark = pytest.mark.engines

PROMPTS = {
    "32 -> 64": ("e32", "d64", "Block sizes differ: the decode engine re-blocks what it pulls. " * 3),
    "64 -> 32": ("d64", "e32", "A larger prefill block is split over smaller decode blocks here. " * 3),
    "TP 2 -> TP 1": ("t2", "e32", "Two prefill ranks each hold one KV head; one decode rank reads both. " * 3),
    "TP 1 -> TP 2": ("e32", "t2", "Each of two decode ranks reads its own head from one prefill rank. " * 3),
    "TP 2 block 32 -> TP 1 block 64": ("t2", "d64", "Heads and block sizes both change on the way over. " * 3),
}


@pytest.fixture(scope="module")
def engines(launched, tmp_path_factory):
    """``({name: URL}, {name: pull stats file})``: ``e32`` is the shared pair's prefill engine; ``d64`` and ``t2``
    start here."""
    logs = tmp_path_factory.mktemp("hetero-logs")
    d64, t2, d64_side, t2_side = free_ports(4)
    specs = {}
    for name, port, side, block, tp in (("d64", d64, d64_side, 64, 1), ("t2", t2, t2_side, 32, 2)):
        specs[name] = EngineSpec(name=name, model=launched.pair.model, port=port, role="prefill",
                                 side_channel_port=side, side_channel_host="127.0.0.1", block_size=block,
                                 max_model_len=1024, tensor_parallel_size=tp,
                                 module_path="p2pkv.connector" if name == "t2" else "",
                                 extra_config={"stats_file": str(logs / f"{name}.jsonl"), "staging_mib": 16},
                                 env={"UCX_NET_DEVICES": "lo", "P2PKV_SECRET": launched.pair.secret})
    children = [start_engine(s, logs) for s in specs.values()]
    try:
        wait_healthy(children, 900)
        urls = {"e32": launched.pair.url("prefill"), **{n: f"http://127.0.0.1:{s.port}" for n, s in specs.items()}}
        yield urls, {"e32": launched.pair.log_dir / "prefill.jsonl", **{n: logs / f"{n}.jsonl" for n in specs}}
    finally:
        stop_children(children)


@pytest.mark.parametrize("row", list(PROMPTS))
@pytest.mark.parametrize("mode", MODES)
def test_tokens_equal_across_block_and_tp_sizes(engines, mode, row) -> None:
    urls, stats = engines
    prefill, decode, prompt = PROMPTS[row]
    prompt = prompt if mode == "pull" else prompt[::-1]  # nothing of it in the prefix caches of the pull run
    with httpx.Client(timeout=300.0) as client:
        pulls_before = len(read_pull_stats(stats[decode]))
        pd = prefill_then_decode(client, urls[prefill], urls[decode], prompt, max_tokens=12, mode=mode)
        ref = complete(client, urls[prefill], prompt, max_tokens=12)
        assert pd.token_ids == ref.token_ids
        assert max_logprob_diff(pd, ref) <= LOGPROB_TOLERANCE
        pulls = read_pull_stats(stats[decode])[pulls_before:]
        if decode == "t2":  # both ranks of the TP 2 engine pull (one head each): two lines
            assert len(pulls) == 2 and pulls[1]["bytes"] == pulls[0]["bytes"]
            pulls = pulls[:1]
        assert len(pulls) == 1 and pulls[0]["bytes"] > 0 and pulls[0]["direction"] == mode
        decode_block = 64 if decode == "d64" else 32
        assert pulls[0]["blocks"] == -(-len(prompt.encode()) // decode_block)
        assert wait_blocks_released(client, urls[prefill], timeout_s=30) == 0.0
