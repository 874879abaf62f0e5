"""A real pipeline-parallel prefill engine (``--pipeline-parallel-size 2``) in front of the session's decode engine.

vLLM's CPU build runs pipeline stages when its warm-up's profile run allocates a later stage's intermediate
tensors (:data:`p2pkv.tools.deploy.engines.CPU_STAGES_COMPILATION_MODE`). Each stage's worker serves its two of
the tiny model's four layers on its own side channel (``port + pp_rank``); the decode engine (TP 1, every layer)
loads each stage's layers from that stage, in every way the proxy asks for. Tokens and logprobs equal the
aggregated engine's, every load reads both stages, and the prefill engine holds nothing afterwards.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from p2pkv.tools import demo
from p2pkv.tools.deploy.engines import EngineSpec, start_engine
from p2pkv.tools.deploy.processes import stop_children, wait_healthy
from tests.conftest import BLOCK, ROUTE_MODES, free_ports, start_mode_proxy

pytestmark = pytest.mark.engines

PROMPT_LENGTH = 150
"""Tokens per prompt (one per byte): five 32-token blocks."""


@pytest.fixture(scope="module")
def staged_prefill(pair, tiny_model, tmp_path_factory):
    """``(LocalPair routed to the PP prefill engine, its URL)``: a role-prefill engine of two stages, with the
    session's secret, beside the session's engines."""
    local, _ = pair
    logs = tmp_path_factory.mktemp("logs-pp2")
    port, side = free_ports(2, run=2)
    spec = EngineSpec(name="pp2", model=str(tiny_model), port=port, role="prefill", side_channel_port=side,
                      side_channel_host="127.0.0.1", block_size=BLOCK, max_model_len=1024,
                      pipeline_parallel_size=2, extra_config={"stream_min_tokens": 0},
                      env={"UCX_NET_DEVICES": "lo", "P2PKV_SECRET": local.secret})
    child = start_engine(spec, logs)
    try:
        wait_healthy([child], 900)
        yield dataclasses.replace(local, prefill_port=port), f"http://127.0.0.1:{port}"
    finally:
        stop_children([child])


@pytest.fixture(scope="module")
def slow_client():
    with httpx.Client(timeout=300.0) as c:
        yield c


def prompt_of(mode: str, i: int) -> str:
    text = "".join(f"stage {mode} {i} carries its layers; " for _ in range(PROMPT_LENGTH))
    return text[:PROMPT_LENGTH]


@pytest.mark.parametrize("mode", ROUTE_MODES)
def test_a_pipeline_parallel_prefill_engines_stages_each_load_their_layers(pair, staged_prefill, slow_client,
                                                                          mode: str) -> None:
    """Through a proxy of each transfer mode: greedy tokens and logprobs equal the aggregated engine's for two
    prompts; each load's line in the decode engine's pull stats names both stages' agents (ranks 0 and 1) and
    moves every layer of the loaded blocks once; the PP engine then holds no block."""
    local, stats = pair
    routed, prefill_url = staged_prefill
    url, proxy = start_mode_proxy(routed, mode)
    try:
        if mode == "stream":  # the proxy learns the prefill engine's address (and pp_size) from a first answer
            demo.complete(slow_client, url, prompt_of(mode, 99)[:40], max_tokens=2)
        for i in range(2):
            prompt = prompt_of(mode, i)
            before = len(demo.read_pull_stats(stats))
            got = demo.complete(slow_client, url, prompt, max_tokens=8)
            ref = demo.complete(slow_client, local.url("aggregated"), prompt, max_tokens=8)
            assert got.token_ids == ref.token_ids, (mode, got.text, ref.text)
            assert demo.max_logprob_diff(got, ref) <= demo.LOGPROB_TOLERANCE
            [line] = demo.read_pull_stats(stats)[before:]
            assert line["direction"] == mode
            ranks = sorted(name.rsplit("-", 2)[1] for name in line["peer"].split(","))  # p2pkv-<id>-tp<rank>-<hex>
            assert ranks == ["tp0", "tp1"], line["peer"]
        assert demo.wait_blocks_released(slow_client, prefill_url, timeout_s=30) == 0.0
    finally:
        stop_children([proxy])
