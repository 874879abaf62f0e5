"""A pipeline-parallel engine at start: a prefill engine's stages are served, a loading engine's are refused.

A PP prefill engine's stages each serve their own layers (``tests/test_pipeline_stages.py`` moves them over
real NIXL: pulled, pushed and streamed); its answers name ``pp_size``. A decode (or ``both``) engine with
stages would have to split each load over them: refused at start, naming the role and the fix. The connector
is checked on a real vLLM config here; a real PP=2 prefill engine serves the session's decode engine in
``tests/test_e2e_pipeline.py``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from p2pkv.config import P2pKvConfig
from p2pkv.engine_facts import UnsupportedParallelismError, check_parallelism_supported, check_stages_supported
from p2pkv.grant import ANY_DECODE, GRANT_KEY, STREAMED_KEY, make_stream_grant
from p2pkv.params import parse_remote_prefill
from p2pkv.scheduler import SchedulerSide

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SECRET = "pipeline-parallel-secret-32-byte"


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_one_stage_is_accepted_for_every_role_and_more_only_for_a_prefill_engine(role: str) -> None:
    check_parallelism_supported(1, role)
    if role == "prefill":
        check_parallelism_supported(4, role)
        return
    with pytest.raises(UnsupportedParallelismError,
                       match=rf"pipeline_parallel_size=2 with role {role}.*--pipeline-parallel-size 1.*role prefill"):
        check_parallelism_supported(2, role)


def test_a_stage_of_a_hybrid_kv_cache_is_refused_naming_the_groups() -> None:
    check_stages_supported(SimpleNamespace(kv_cache_groups=[object()]))
    with pytest.raises(UnsupportedParallelismError, match="2 KV cache groups"):
        check_stages_supported(SimpleNamespace(kv_cache_groups=[object(), object()]))


def _connector(tiny_model, kv_role: str, role: str):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from p2pkv.connector import P2pKvConnector

    ktc = KVTransferConfig(kv_connector="P2pKvConnector", kv_role=kv_role,
                           kv_connector_extra_config={"side_channel_port": 5600, "side_channel_host": "127.0.0.1",
                                                      "insecure": True})
    config = EngineArgs(model=str(tiny_model), dtype="float32", max_model_len=512, enforce_eager=True,
                        pipeline_parallel_size=2, distributed_executor_backend="mp",
                        kv_transfer_config=ktc).create_engine_config()
    assert config.parallel_config.pipeline_parallel_size == 2
    return P2pKvConnector(config, KVConnectorRole[role])


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_connector_refuses_a_pipeline_parallel_decode_engine_in_either_role(tiny_model, role: str) -> None:
    with pytest.raises(UnsupportedParallelismError, match="pipeline_parallel_size=2 with role decode"):
        _connector(tiny_model, "kv_consumer", role)


def test_a_pipeline_parallel_prefill_engines_scheduler_names_its_stages(tiny_model) -> None:
    connector = _connector(tiny_model, "kv_producer", "SCHEDULER")
    try:
        assert connector.pp_size == 2 and connector.scheduler.prefill.pp_size == 2
    finally:
        connector.scheduler.shutdown()


def _sched() -> SchedulerSide:
    config = P2pKvConfig(lease_s=30.0, secret=SECRET, role="prefill")
    return SchedulerSide("prefill-engine", config, 16, "127.0.0.1", 5600, 2, role="prefill", num_blocks=100,
                         pp_size=2)


def test_a_staged_engines_answer_names_pp_size_and_a_stream_grant_is_streamed() -> None:
    """The answer's ``pp_size`` is signed (the decode engine parses it under the secret) and its workers are the
    tp x pp ranks; a request carrying a stream grant is admitted for every stage's workers (each streams its
    layers) and its answer carries the streamed mark. A grant signed for one stage (``pp_size`` 1) is not
    streamed here: that request is held for a pull or push, its answer without the mark."""
    sched = _sched()
    try:
        one_stage = make_stream_grant("prefill-engine", ANY_DECODE, SECRET.encode(), time.time() + 60)
        other = Request("s-0", list(range(3, 3 + 32)), SamplingParams(max_tokens=1), None)
        other.kv_transfer_params = {"do_remote_decode": True, GRANT_KEY: one_stage}
        sched.on_new_request(other)
        assert "s-0" not in sched.streams
        other.num_computed_tokens = other.num_prompt_tokens
        other.status = RequestStatus.FINISHED_LENGTH_CAPPED
        hold, answer = sched.request_finished_all_groups(other, ([3, 4],))
        assert hold and STREAMED_KEY not in answer and answer["pp_size"] == 2
        grant = make_stream_grant("prefill-engine", ANY_DECODE, SECRET.encode(), time.time() + 60, pp_size=2)
        req = Request("s-1", list(range(3, 3 + 32)), SamplingParams(max_tokens=1), None)
        req.kv_transfer_params = {"do_remote_decode": True, GRANT_KEY: grant}
        sched.on_new_request(req)
        assert "s-1" in sched.streams and list(sched.build_connector_meta().stream_admits) == ["s-1"]
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        hold, answer = sched.request_finished_all_groups(req, ([1, 2],))
        assert hold and answer[STREAMED_KEY] is True and answer["pp_size"] == 2
        remote = parse_remote_prefill(answer, secret=SECRET.encode())
        assert (remote.tp_size, remote.pp_size, remote.num_ranks) == (2, 2, 4)
    finally:
        sched.shutdown()
