"""Data parallel: each DP rank of an engine serves its own side channels and names them in its params.

vLLM runs each DP rank of a dense model as an independent engine core and
sets ``parallel_config.data_parallel_index`` to its rank
(``vllm/v1/engine/core.py``); p2pkv's rank ``tp_rank`` of DP rank ``dp``
listens on ``side_channel_port + dp * tp_size + tp_rank``, and the
``kv_transfer_params`` a DP rank returns carry its own base port, so a
decode engine pulls from the DP rank that prefilled the request. Real vLLM
configs of the tiny model, set up the way vLLM's engine core sets up a DP rank.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _dp_rank_config(model: str, dp_size: int, dp_rank: int, tp_size: int):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    ktc = KVTransferConfig(kv_connector="P2pKvConnector", kv_role="kv_both",
                           kv_connector_extra_config={"side_channel_port": 5600, "side_channel_host": "127.0.0.1",
                                                      "insecure": True})
    config = EngineArgs(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
                        data_parallel_size=dp_size, tensor_parallel_size=tp_size,
                        kv_transfer_config=ktc).create_engine_config()
    config.parallel_config.data_parallel_index = dp_rank  # what vLLM's engine core does for each DP rank
    config.parallel_config.reconfigure_for_independent_dp_rank()
    return config


@pytest.mark.parametrize("tp_size", [1, 2])
def test_each_dp_rank_returns_params_naming_its_own_side_channel(tiny_model, tp_size) -> None:
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import Request, RequestStatus

    from p2pkv.connector import P2pKvConnector

    ports = []
    for dp_rank in range(3):
        conn = P2pKvConnector(_dp_rank_config(str(tiny_model), 3, dp_rank, tp_size), KVConnectorRole.SCHEDULER)
        try:
            req = Request(f"r{dp_rank}", list(range(3, 40)), SamplingParams(max_tokens=1), None)
            req.kv_transfer_params = {"do_remote_decode": True}
            req.status, req.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 37
            hold, params = conn.request_finished(req, [4, 5])
            assert hold and params["tp_size"] == tp_size
            ports.append(params["remote_port"])
        finally:
            conn.shutdown()
    assert ports == [5600 + dp * tp_size for dp in range(3)]  # rank r of DP rank dp: + r on top
