"""Lease heartbeats: a decode engine keeps prefill leases alive for requests still queued."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from handshake import (
    Destination,
    HandshakeServer,
    HandshakeTimeoutError,
    HoldLink,
    HoldsReply,
    HoldStatus,
    RemoteRefusedError,
    query_holds,
    release_holds,
    send_heartbeat,
)
from handshake.fingerprints import fingerprint
from p2pkv.config import ConfigError, P2pKvConfig, load_config
from p2pkv.metadata import P2pKvMetadata
from p2pkv.params import make_prefill_response_params
from p2pkv.scheduler import SchedulerSide
from p2pkv.testing import make_kv_caches
from p2pkv.worker import WorkerSide
from tests.handshake_support import make_agent_info
from tests.workers import COMPAT_FIELDS, NUM_BLOCKS, SHAPE, free_port, model_info

HOST = "127.0.0.1"
ENGINE = "prefill-engine"  # make_agent_info's engine id


def _server(secret: bytes | None = None, **callbacks: object) -> HandshakeServer:
    """A started side-channel server serving rank 0 of ENGINE (hold requests name it as their destination)."""
    srv = HandshakeServer(HOST, 0, "h", secret=secret, **callbacks)  # type: ignore[arg-type]
    srv.set_info(make_agent_info(0, compat_hash="h"))
    srv.start()
    return srv


def _beat(port: int, ids: list[str], extend_s: float = 30.0, **kwargs: object) -> HoldsReply:
    return send_heartbeat(Destination(HOST, port, ENGINE, 0), ids, "decode", extend_s,
                          **kwargs)  # type: ignore[arg-type]


def test_heartbeat_round_trip_and_refusal() -> None:
    got: list[tuple[list[str], float, list[list[int]]]] = []
    with _server(on_heartbeat=lambda ids, s, b: got.append((ids, s, b))) as srv:
        assert _beat(srv.port, ["a", "b"]).accepted == 2
        assert got == [(["a", "b"], 30.0, [])]  # a heartbeat asks about no block ids
        with pytest.raises(RemoteRefusedError) as info:  # another destination: not extended
            send_heartbeat(Destination(HOST, srv.port, "other-engine", 0), ["a"], "decode", 30.0)
        assert (info.value.code, info.value.field) == ("wrong_destination", "to_engine_id")
        with pytest.raises(RemoteRefusedError) as info:
            send_heartbeat(Destination(HOST, srv.port, ENGINE, 1), ["a"], "decode", 30.0)
        assert (info.value.code, info.value.field) == ("unknown_rank", "to_rank")
        assert len(got) == 1
    with _server() as srv, pytest.raises(RemoteRefusedError, match="holds no requests"):
        _beat(srv.port, ["a"])
    with _server(secret=b"k", on_heartbeat=lambda ids, s, b: got.append((ids, s, b))) as srv:
        assert _beat(srv.port, ["a"], 5.0, secret=b"k").accepted == 1
        # Another secret: no CURVE session, so no answer at all (and no extension).
        with pytest.raises(HandshakeTimeoutError):
            _beat(srv.port, ["a"], 5.0, secret=b"wrong", timeout_s=0.3)
        assert len(got) == 2 and srv.stats["served"] == 1 and srv.stats["refused"] == 0


def test_hold_queries_and_releases_carry_block_ids() -> None:
    asked: list[tuple[list[str], float, list[list[int]]]] = []
    freed: list[tuple[list[str], list[list[int]]]] = []

    def on_heartbeat(ids: list[str], extend_s: float, blocks: list[list[int]]) -> HoldStatus:
        asked.append((ids, extend_s, blocks))
        return HoldStatus(not_held=["b"])

    def on_release(ids: list[str], blocks: list[list[int]], requester: str) -> int:
        freed.append((ids, blocks))
        return 1

    with _server(secret=b"k", on_heartbeat=on_heartbeat, on_release=on_release) as srv:
        reply = query_holds(Destination(HOST, srv.port, ENGINE, 0), ["a", "b"], [[1, 2], [3]], "decode", 5.0,
                            secret=b"k")
        assert (reply.accepted, reply.not_held) == (2, ["b"])
        assert asked == [(["a", "b"], 5.0, [[1, 2], [3]])]
        reply = release_holds(Destination(HOST, srv.port, ENGINE, 0), ["a"], [[1, 2]], "decode", secret=b"k")
        assert reply.accepted == 1 and freed == [(["a"], [[1, 2]])]
        with pytest.raises(ValueError, match="block_ids"):
            release_holds(Destination(HOST, srv.port, ENGINE, 0), ["a", "b"], [[1]], "decode", secret=b"k")
        with pytest.raises(RemoteRefusedError) as info:  # a release for another engine frees nothing
            release_holds(Destination(HOST, srv.port, "other", 0), ["a"], [[1, 2]], "decode", secret=b"k")
        assert info.value.code == "wrong_destination" and len(freed) == 1


def test_hold_link_reuses_one_connection_and_skips_a_late_reply() -> None:
    """Questions over a HoldLink each get their own answer; the answer to one that timed out arrives
    late on the same connection and is skipped, not taken for the next question's."""
    slow = threading.Event()

    def on_heartbeat(ids: list[str], extend_s: float, blocks: list[list[int]]) -> HoldStatus:
        if slow.is_set():
            slow.clear()
            time.sleep(0.3)
        return HoldStatus(not_held=[i for i in ids if i.startswith("gone")])

    def ask(ids: list[str], link: HoldLink, **kwargs: object) -> HoldsReply:
        return query_holds(Destination(HOST, srv.port, ENGINE, 0), ids, [[1]] * len(ids), "d", 5.0, secret=b"k",
                           link=link, **kwargs)  # type: ignore[arg-type]

    with _server(secret=b"k", on_heartbeat=on_heartbeat) as srv:
        link = HoldLink(HOST, srv.port, secret=b"k")
        try:
            assert ask(["a"], link).accepted == 1
            slow.set()
            with pytest.raises(HandshakeTimeoutError):
                ask(["gone-1"], link, timeout_s=0.1)
            reply = ask(["b"], link, timeout_s=2.0)
            assert reply.not_held == [] and reply.accepted == 1  # not the late "gone-1" answer (its nonce differs)
            assert srv.stats["heartbeats"] == 3
        finally:
            link.close()
        wrong = HoldLink(HOST, srv.port, secret=b"wrong")  # another secret: the link never connects
        try:
            with pytest.raises(HandshakeTimeoutError):
                query_holds(Destination(HOST, srv.port, ENGINE, 0), ["a"], [[1]], "d", 5.0, secret=b"wrong", link=wrong,
                            timeout_s=0.3)
            assert srv.stats["heartbeats"] == 3
        finally:
            wrong.close()


def test_heartbeats_go_every_quarter_lease() -> None:
    assert load_config({"lease_s": 8}, environ={}).heartbeat_every_s == 2.0
    assert load_config(None, environ={}).heartbeat_every_s == 30.0
    with pytest.raises(ConfigError, match=r"heartbeat_interval_s.*lease_s / 4"):
        load_config({"heartbeat_interval_s": 10}, environ={})


def _prefill_worker(lease_s: float) -> WorkerSide:
    port = free_port()
    cfg = P2pKvConfig(side_channel_host="127.0.0.1", side_channel_port=port, lease_s=lease_s, insecure=True)
    worker = WorkerSide("prefill-engine", cfg, 0, 1, "127.0.0.1", port, fingerprint(COMPAT_FIELDS), model_info("BLHNC"))
    _, views = make_kv_caches("BLHNC", **SHAPE)
    worker.register_kv_caches(views, NUM_BLOCKS)
    return worker


def test_heartbeats_keep_a_lease_until_they_stop() -> None:
    worker = _prefill_worker(lease_s=0.6)
    try:
        assert worker.server is not None
        port = worker.server.port
        worker.start_load_kv(P2pKvMetadata(send_leases={"kept": time.monotonic() + 0.6,
                                                        "dropped": time.monotonic() + 0.6}))
        released: list[str] = []
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # 3x the lease, heartbeats every 0.2 s
            send_heartbeat(Destination("127.0.0.1", port, "prefill-engine", 0), ["kept", "unknown"], "decode", 0.6)
            for _ in range(4):
                released += sorted(worker.get_finished()[0])
                time.sleep(0.05)
        assert released == ["dropped"]
        end = time.monotonic() + 3.0
        while "kept" not in released and time.monotonic() < end:
            released += sorted(worker.get_finished()[0])
            time.sleep(0.05)
        assert released == ["dropped", "kept"]  # expired once heartbeats stopped
    finally:
        worker.shutdown()


def test_decode_scheduler_sends_heartbeats_for_queued_requests_only() -> None:
    got: list[list[str]] = []
    event = threading.Event()

    def on_heartbeat(ids: list[str], extend_s: float, block_ids: list[list[int]]) -> None:
        got.append(sorted(ids))
        event.set()

    with HandshakeServer("127.0.0.1", 0, "h", on_heartbeat=on_heartbeat) as srv:
        srv.set_info(make_agent_info(0, engine_id="p", compat_hash="h"))  # heartbeats name engine "p", rank 0
        cfg = P2pKvConfig(lease_s=20.0)  # heartbeats every 5 s
        sched = SchedulerSide("decode-engine", cfg, 32, "127.0.0.1", 5600, 1)
        reqs = []
        for i in range(3):
            params = make_prefill_response_params(engine_id="p", request_id=f"prefill-{i}", host="127.0.0.1",
                                                  port=srv.port, block_ids=[1], tp_size=1, num_tokens=5,
                                                  expiry_time=None)
            reqs.append(SimpleNamespace(request_id=f"decode-{i}", kv_transfer_params=params, prompt_token_ids=[0] * 5))
            sched.on_new_request(reqs[-1])
        sched.on_new_request(SimpleNamespace(request_id="plain", kv_transfer_params=None, prompt_token_ids=[0]))
        # request 0 got its blocks (pull scheduled), request 1 was aborted while queued
        sched.decode._queued.pop("decode-0")
        sched.request_finished(reqs[1], [])
        assert sched.send_heartbeats(now=100.0) == 1
        assert event.wait(30.0)
        assert got == [["prefill-2"]]
        assert sched.send_heartbeats(now=101.0) == 0  # not before the interval
        assert sched.send_heartbeats(now=106.0) == 1
        sched.shutdown()
        assert sched.decode.heartbeats.failed == 0 and sched.decode.heartbeats.sent == 2
        # The aborted request produced a notify-only task for its prefill engine.
        meta = sched.build_connector_meta()
        assert [(t.request_id, t.local_block_ids, t.report) for t in meta.loads] == [("decode-1", (), False)]


def test_queued_request_params_are_parsed_once_with_the_same_outcome() -> None:
    """A queued request's params, parsed on arrival for heartbeats, give the same pull as a fresh parse,
    and a prompt of another length is still refused."""
    blocks = SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],), get_unhashed_block_ids_all_groups=lambda: [[6, 7]])
    specs = []
    for announced in (True, False):  # on_new_request first (queued), or not (parsed at each hook)
        sched = SchedulerSide("decode-engine", P2pKvConfig(lease_s=30.0), 4, "127.0.0.1", 5600, 1)
        reqs = {}
        for rid, prompt in (("ok", 10), ("other-prompt", 9)):
            params = make_prefill_response_params(engine_id="p", request_id=f"prefill-{rid}", host="127.0.0.1",
                                                  port=5601, block_ids=[1, 2, 3], tp_size=1, num_tokens=10,
                                                  expiry_time=None)
            reqs[rid] = SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=[0] * prompt)
            if announced:
                sched.on_new_request(reqs[rid])
        assert len(sched.decode._queued) == (2 if announced else 0)
        assert sched.get_num_new_matched_tokens(reqs["other-prompt"], 0) == (0, False)
        assert reqs["other-prompt"].kv_transfer_params["do_remote_prefill"] is False
        assert "other-prompt" not in sched.decode._queued  # prefilled locally: its prefill lease is not kept alive
        assert sched.get_num_new_matched_tokens(reqs["ok"], 4) == (6, True)
        sched.update_state_after_alloc(reqs["ok"], blocks, 6)
        assert "ok" not in sched.decode._queued
        specs.append([(t.request_id, t.local_block_ids, t.remote_block_ids, t.remote, t.first_token, t.num_tokens)
                      for t in sched.build_connector_meta().loads])
        sched.shutdown()
    assert specs[0] == specs[1] == [("ok", (6, 7), (1, 2, 3), specs[0][0][3], 4, 10)]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pull_after_the_lease_expired_is_fenced(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """The prefill lease runs out before the decode engine pulls: the READ itself succeeds
    (the bytes are still there), but the blocks may have been reused, so the pull must be
    reported as failed; a pull within its lease succeeds and is released by notification.
    In push mode the prefill rank answers the push request ``expired`` and writes nothing."""
    from tests.workers import make_worker, task

    prefill = _prefill_worker(lease_s=0.3)
    decode_base, views = make_kv_caches("BLHNC", fill=0.0, **SHAPE)
    decode = make_worker("decode-engine", free_port(), transfer_mode=mode)
    decode.model = model_info("BLHNC")
    decode.register_kv_caches(views, NUM_BLOCKS)
    try:
        assert prefill.server is not None
        port = prefill.server.port
        now = time.monotonic()
        prefill.start_load_kv(P2pKvMetadata(send_leases={"late": now + 0.3, "on-time": now + 30}))
        released: list[str] = []
        while "late" not in released and time.monotonic() < now + 5:
            released += sorted(prefill.get_finished()[0])
            time.sleep(0.02)
        assert released == ["late"]
        decode.start_load_kv(P2pKvMetadata(loads=[task("d-late", "late", port, [1, 2], [3, 4]),
                                                 task("d-ok", "on-time", port, [5], [6])]))
        errors: set[int] = set()
        finished: set[str] = set()
        end = time.monotonic() + 20
        while finished != {"d-late", "d-ok"} and time.monotonic() < end:
            finished |= decode.get_finished()[1]
            errors |= decode.get_block_ids_with_load_errors()
            released += sorted(prefill.get_finished()[0])
            time.sleep(0.01)
        assert finished == {"d-late", "d-ok"}
        assert errors == {1, 2}
        assert "kind=lease_expired request=d-late " in caplog.text
        while "on-time" not in released and time.monotonic() < end:
            released += sorted(prefill.get_finished()[0])
            decode.get_finished()  # the decode engine keeps stepping (its steps send the "done")
            time.sleep(0.01)
        assert released == ["late", "on-time"]
        if mode == "push":  # nothing written for the expired hold; the other one's bytes moved
            assert torch.count_nonzero(decode_base[[1, 2]]) == 0 and torch.count_nonzero(decode_base[5]) > 0
            assert decode.stats.data["directions"] == {"push": 1}
    finally:
        decode.shutdown()
        prefill.shutdown()
