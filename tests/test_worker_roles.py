"""A rank builds only the parts its role uses: a decode rank holds nothing for anyone, so it has no push or
stream side (no :class:`p2pkv.prefill.pusher.Pusher`, no :class:`p2pkv.prefill.prefill_streams.PrefillStreams`)
and its side channel refuses push and stream requests naming the fix; it still loads KV (its Receiver) and
answers hold questions. A prefill rank loads nothing, so it has no Receiver. A ``both`` or ``prefill`` rank holds
for decode engines: push and streams, on one WRITE thread."""

from __future__ import annotations

import logging

import pytest

from handshake import Destination, RemoteRefusedError, query_holds, request_push
from p2pkv.metadata import LoadSpec, P2pKvMetadata
from p2pkv.params import RemotePrefill
from p2pkv.testing import make_kv_caches
from tests.handshake_support import make_agent_info
from tests.workers import NUM_BLOCKS, SHAPE, free_port, make_worker, run_until_received


@pytest.mark.parametrize("role", ["decode", "prefill", "both"])
def test_a_rank_builds_the_parts_of_its_role_and_its_side_channel_takes_what_they_serve(role: str) -> None:
    port = free_port()
    worker = make_worker("engine-a", port)
    worker.role = role  # as the connector passes it (p2pkv.config.engine_role)
    try:
        _, views = make_kv_caches("BLHNC", seed=1, **SHAPE)
        worker.register_kv_caches(views, NUM_BLOCKS)
        assert (worker.receiver is None) == (role == "prefill"), "a decode or both rank loads KV, a prefill rank not"
        assert worker.get_finished() == (set(), set())
        assert (worker.pusher is None, worker.streams is None, worker.writes is None) == ((role == "decode"),) * 3
        if worker.writes is not None:  # push and the layer streams take their turns on one WRITE thread
            assert worker.pusher.engine is worker.writes and worker.streams.engine is worker.writes  # type: ignore
            assert worker.writes.thread.name == "p2pkv-write" and worker.writes.thread.is_alive()
        to = Destination("127.0.0.1", port, "engine-a", 0)
        status = query_holds(to, ["nobody-holds-this"], [[1]], "decode-b:0", 1.0, timeout_s=5.0)
        assert status.unknown == ["nobody-holds-this"]
        if role == "decode":
            with pytest.raises(RemoteRefusedError) as info:
                request_push(to, "req", [1], b"p" * 16, make_agent_info(0, engine_id="decode-b"), b"", b"", 5.0,
                             "decode-b:0", timeout_s=5.0)
            assert (info.value.code, info.value.field) == ("malformed", "type")
            assert "takes no push requests" in str(info.value)
    finally:
        worker.shutdown()
    assert worker.writes is None or not worker.writes.thread.is_alive(), "the WRITE thread outlived its worker"


def test_a_both_rank_refuses_params_naming_itself_by_name(caplog: pytest.LogCaptureFixture) -> None:
    """Both legs on one ``both`` engine: the params name the engine that would load them; the load fails at once
    (its blocks as load errors, nobody contacted), the log naming the field and the fix."""
    port = free_port()
    worker = make_worker("engine-a", port)
    try:
        _, views = make_kv_caches("BLHNC", seed=1, **SHAPE)
        worker.register_kv_caches(views, NUM_BLOCKS)
        itself = RemotePrefill("engine-a", "prefilled-here", "127.0.0.1", port, (3, 4), 1)
        with caplog.at_level(logging.WARNING, logger="p2pkv"):
            worker.start_load_kv(P2pKvMetadata(loads=[LoadSpec("d-1", (1, 2), (3, 4), itself)]))
            assert run_until_received(worker, "d-1", timeout_s=10) == {1, 2}
        assert "remote_engine_id='engine-a' is this engine" in caplog.text
    finally:
        worker.shutdown()
