"""A pipeline-parallel engine is refused at start with an error naming ``pipeline_parallel_size`` and the fix.

Each pipeline stage's workers hold only their own layers, and every p2pkv plan describes one rank's KV for
every layer; until stages are negotiated (their layer ranges in the handshake, the capability and the stream
grant), a PP engine would hand out params for part of the model as if it were all of it. vLLM's CPU build
(0.32.0) starts a PP=2 engine of the tiny model but fails its first forward (the second stage's
``intermediate_tensors`` are never allocated), so the refusal is checked on a real vLLM config here.
"""

from __future__ import annotations

import pytest

from p2pkv.engine_facts import UnsupportedParallelismError, check_parallelism_supported

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_one_stage_is_accepted_and_more_are_refused_naming_the_setting_and_the_fix() -> None:
    check_parallelism_supported(1)
    with pytest.raises(UnsupportedParallelismError, match=r"pipeline_parallel_size=2.*--pipeline-parallel-size 1"):
        check_parallelism_supported(2)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_connector_refuses_a_pipeline_parallel_engine_in_either_role(tiny_model, role: str) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from p2pkv.connector import P2pKvConnector

    ktc = KVTransferConfig(kv_connector="P2pKvConnector", kv_role="kv_producer",
                           kv_connector_extra_config={"side_channel_port": 5600, "side_channel_host": "127.0.0.1",
                                                      "insecure": True})
    config = EngineArgs(model=str(tiny_model), dtype="float32", max_model_len=512, enforce_eager=True,
                        pipeline_parallel_size=2, distributed_executor_backend="mp",
                        kv_transfer_config=ktc).create_engine_config()
    assert config.parallel_config.pipeline_parallel_size == 2
    with pytest.raises(UnsupportedParallelismError, match="pipeline_parallel_size=2"):
        P2pKvConnector(config, KVConnectorRole[role])
