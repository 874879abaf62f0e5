"""Every side-channel message is bounded (ids, block ids, bytes, strings, regions) and its encoding fits the bound
:mod:`handshake.bounds` derives for it; MAX_MESSAGE_BYTES is the largest; payloads over FRAME_BYTES travel in
frames of FRAME_BYTES; senders split hold batches to stay within the bounds."""

from __future__ import annotations

import time

import msgspec
import pytest

from handshake import (
    PROTOCOL_VERSION,
    AgentInfo,
    Destination,
    ErrorReply,
    HandshakeServer,
    HoldQuery,
    HoldsReply,
    KVLayoutDesc,
    KVRegion,
    LeaseHeartbeat,
    MalformedMessageError,
    MetadataReply,
    PushRequest,
    ReleaseHolds,
    compute_digest,
    decode,
    encode,
    query_holds,
)
from handshake import bounds as b
from handshake import fields as f
from handshake import messages as m
from handshake.client import _hold_requests
from handshake.codec import FRAME_BYTES, MAC_BYTES
from p2pkv.params import MAX_BLOCK_IDS
from tests.handshake_support import make_agent_info

SECRET = b"k" * 16
TO = Destination("127.0.0.1", 1, "p", 0)
WIDE = "\U0001f600"  # 4 bytes in UTF-8: the widest a bounded string can be
BIG = (1 << 63) - 1  # 9 bytes in msgpack
IDS = [WIDE * m.MAX_ID_CHARS] * m.MAX_HEARTBEAT_IDS
HEAD = {"protocol_version": PROTOCOL_VERSION, "to_engine_id": WIDE * m.MAX_ID_CHARS, "to_rank": 0,
        "sent_at": time.time(), "nonce": b"n" * 64, "requester_engine_id": WIDE * m.MAX_ID_CHARS}


def block_lists(total: int, lists: int) -> list[list[int]]:
    """``total`` block ids (the largest, 5 bytes each) in ``lists`` lists."""
    per, extra = divmod(total, lists)
    return [[(1 << 31) - 1] * (per + (i < extra)) for i in range(lists)]


def largest_agent_info() -> AgentInfo:
    region = KVRegion(base_addr=BIG, length=BIG, device_id=BIG, layer_start=BIG, num_layers=BIG, kv_index=-BIG)
    layout = KVLayoutDesc(kv_layout=WIDE * f.MAX_WORD_CHARS, attn_layout=WIDE * f.MAX_WORD_CHARS,
                          dtype=WIDE * f.MAX_WORD_CHARS, num_layers=BIG, num_kv_heads=BIG, head_dim=BIG,
                          block_size=BIG, num_blocks=BIG, block_len=BIG, block_stride=BIG,
                          mem_type=WIDE * f.MAX_WORD_CHARS, regions=[region] * m.MAX_REGIONS, total_num_kv_heads=BIG,
                          is_mla=True)
    metadata = b"m" * m.MAX_AGENT_METADATA_BYTES
    extra = {"staging": [region] * m.MAX_REGIONS} if "staging" in AgentInfo.__struct_fields__ else {}
    return AgentInfo(engine_id=WIDE * m.MAX_ID_CHARS, tp_rank=BIG, tp_size=BIG, agent_name=WIDE * m.MAX_NAME_CHARS,
                     agent_metadata=metadata, metadata_digest=b"d" * 64, compat_hash=WIDE * f.MAX_COMPAT_CHARS,
                     layout=layout, **extra)


LARGEST = {
    "hold_query": (lambda: HoldQuery(**HEAD, request_ids=IDS, block_ids=block_lists(m.MAX_HOLD_BLOCK_IDS, len(IDS)),
                                     extend_s=3600.0), b.HOLD_REQUEST_BYTES),
    "release_holds": (lambda: ReleaseHolds(**HEAD, request_ids=IDS,
                                           block_ids=block_lists(m.MAX_HOLD_BLOCK_IDS, len(IDS))),
                      b.HOLD_REQUEST_BYTES),
    "lease_heartbeat": (lambda: LeaseHeartbeat(**HEAD, request_ids=IDS, extend_s=3600.0), b.HOLD_REQUEST_BYTES),
    "holds_reply": (lambda: HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=BIG, expired=IDS, not_held=IDS,
                                       unknown=IDS, request_ids=IDS, nonce=b"n" * 64), b.HOLDS_REPLY_BYTES),
    "metadata_reply": (lambda: MetadataReply(protocol_version=PROTOCOL_VERSION, info=largest_agent_info(),
                                             nonce=b"n" * 64), b._FIXED + b.AGENT_INFO_BYTES + 69),
    "push_request": (lambda: PushRequest(**HEAD, request_id=WIDE * m.MAX_ID_CHARS,
                                         block_ids=[(1 << 31) - 1] * m.MAX_HOLD_BLOCK_IDS, push_id=b"p" * 32,
                                         agent=largest_agent_info(), source_rows=b"r" * (m.MAX_PUSH_ROWS * 24),
                                         target_rows=b"r" * (m.MAX_PUSH_ROWS * 24), window_s=3600.0),
                     b.PUSH_REQUEST_BYTES),
    "error": (lambda: ErrorReply(protocol_version=PROTOCOL_VERSION, code="internal", field=WIDE * m.MAX_ID_CHARS,
                                 message=WIDE * f.MAX_TEXT_CHARS, nonce=b"n" * 64), b._FIXED + 1029 + 8197 + 69),
}


@pytest.mark.parametrize("kind", list(LARGEST))
def test_the_largest_message_of_each_kind_fits_its_bound_and_max_message_bytes(kind: str) -> None:
    make, bound = LARGEST[kind]
    msg = make()
    frames = encode(msg, SECRET)  # type: ignore[arg-type]
    payload = sum(len(f) for f in frames[:-1])
    assert payload <= bound, f"{kind}: {payload} bytes, its bound says {bound}"
    assert payload + MAC_BYTES <= b.MAX_MESSAGE_BYTES
    assert all(len(f) == FRAME_BYTES for f in frames[:-2]) and 0 < len(frames[-2]) <= FRAME_BYTES
    assert decode(frames, SECRET) == msg


def test_max_message_bytes_is_derived_from_the_bounds() -> None:
    assert b.MAX_MESSAGE_BYTES == 23 * 2**20  # docs/protocol.md and docs/security.md give this figure
    assert b.PUSH_REQUEST_BYTES + MAC_BYTES <= b.MAX_MESSAGE_BYTES < b.PUSH_REQUEST_BYTES + MAC_BYTES + 2**20
    assert max(b.HOLDS_REPLY_BYTES, b.HOLD_REQUEST_BYTES, b.AGENT_INFO_BYTES) < b.PUSH_REQUEST_BYTES
    assert m.MAX_HOLD_BLOCK_IDS == MAX_BLOCK_IDS  # a release names a hold's block ids whole, in one message


def small_head() -> dict:
    return {**HEAD, "to_engine_id": "p", "requester_engine_id": "d"}


def info_with(**fields: object) -> AgentInfo:
    return msgspec.structs.replace(make_agent_info(0), **fields)


@pytest.mark.parametrize(("msg", "field"), [
    (lambda: MetadataReply(protocol_version=PROTOCOL_VERSION, info=info_with(
        agent_metadata=b"m" * (m.MAX_AGENT_METADATA_BYTES + 1))), "info.agent_metadata"),
    (lambda: MetadataReply(protocol_version=PROTOCOL_VERSION,
                           info=info_with(compat_hash="c" * (f.MAX_COMPAT_CHARS + 1))), "info.compat_hash"),
    (lambda: MetadataReply(protocol_version=PROTOCOL_VERSION, info=info_with(layout=msgspec.structs.replace(
        make_agent_info(0).layout, regions=[KVRegion(base_addr=0, length=1)] * (m.MAX_REGIONS + 1)))),
     "info.layout.regions"),
    (lambda: {"type": "hold_query", **small_head(), "request_ids": ["a", "b"],  # a HoldQuery refuses it at once
              "block_ids": block_lists(m.MAX_HOLD_BLOCK_IDS + 1, 2), "extend_s": 1.0}, "block_ids"),
    (lambda: ReleaseHolds(**small_head(), request_ids=["a"] * (m.MAX_HEARTBEAT_IDS + 1),
                          block_ids=[[1]] * (m.MAX_HEARTBEAT_IDS + 1)), "request_ids"),
    (lambda: ErrorReply(protocol_version=PROTOCOL_VERSION, code="internal", field="f",
                        message="x" * (f.MAX_TEXT_CHARS + 1)), "message"),
], ids=["agent_metadata", "compat_hash", "regions", "hold_block_ids", "hold_ids", "error_message"])
def test_one_past_a_bound_is_refused_naming_the_field(msg: object, field: str) -> None:
    value = msg()  # type: ignore[operator]
    payload = msgspec.msgpack.encode(value) if isinstance(value, dict) else encode(value)[0]
    frames = [payload[i:i + FRAME_BYTES] for i in range(0, len(payload), FRAME_BYTES)]
    with pytest.raises(MalformedMessageError) as info:
        decode(frames)
    assert info.value.field == field


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
def test_a_payload_over_frame_bytes_travels_in_frames(secret: bytes | None) -> None:
    msg = MetadataReply(protocol_version=PROTOCOL_VERSION, info=info_with(agent_metadata=b"m" * (2 * FRAME_BYTES)))
    frames = encode(msg, secret)
    parts = frames[:-1] if secret else frames
    assert [len(f) for f in parts[:-1]] == [FRAME_BYTES] * 2 and 0 < len(parts[-1]) <= FRAME_BYTES
    assert decode(frames, secret) == msg
    for bad in ([parts[0][:-1], parts[0][-1:] + parts[1], parts[2]],  # cut elsewhere
                [parts[0], parts[1] + parts[2]],  # a frame over FRAME_BYTES
                [*parts, b""]):  # an empty last frame
        with pytest.raises(MalformedMessageError) as info:
            decode(bad + frames[len(parts):], secret)
        assert info.value.field == "frames"


def test_a_two_frame_payload_without_a_secret_is_not_taken_for_an_hmac() -> None:
    size = FRAME_BYTES
    while True:  # metadata of the size that makes the payload FRAME_BYTES + 32 bytes
        msg = MetadataReply(protocol_version=PROTOCOL_VERSION, info=info_with(agent_metadata=b"m" * size))
        frames = encode(msg)
        extra = sum(map(len, frames)) - (FRAME_BYTES + MAC_BYTES)
        if not extra:
            break
        size -= extra
    assert [len(f) for f in frames] == [FRAME_BYTES, MAC_BYTES]
    assert decode(frames) == msg


def test_hold_batches_are_split_within_the_bounds() -> None:
    ids = [f"r{i}" for i in range(m.MAX_HEARTBEAT_IDS + 10)]
    blocks = [[i] * (200_000 if i < 10 else 1) for i in range(len(ids))]  # 2 M block ids in the first 10 ids
    msgs = _hold_requests(HoldQuery, TO, ids, blocks, "d", extend_s=1.0)
    assert [len(msg.request_ids) for msg in msgs] == [5, m.MAX_HEARTBEAT_IDS, 5]  # by block ids, by ids
    for msg in msgs:
        assert len(msg.request_ids) <= m.MAX_HEARTBEAT_IDS
        assert sum(map(len, msg.block_ids)) <= m.MAX_HOLD_BLOCK_IDS  # type: ignore[union-attr]
        assert decode(encode(msg, SECRET), SECRET) == msg
    assert [i for msg in msgs for i in msg.request_ids] == ids
    assert [b for msg in msgs for b in msg.block_ids] == blocks  # type: ignore[union-attr]
    assert len(_hold_requests(LeaseHeartbeat, TO, ids, None, "d", extend_s=1.0)) == 2
    assert len(_hold_requests(LeaseHeartbeat, TO, [], None, "d", extend_s=1.0)) == 1
    with pytest.raises(ValueError, match="block ids"):
        _hold_requests(ReleaseHolds, TO, ["a"], [[1] * (m.MAX_HOLD_BLOCK_IDS + 1)], "d")


def test_a_fence_batch_over_one_message_is_asked_in_several_and_answered() -> None:
    """Three pulls of 400,000 block ids each (1.2 M in all): two HoldQuery messages (about 3.8 and 1.9 MiB),
    each in frames of 256 KiB over CURVE, both answered."""
    asked: list[list[str]] = []

    def on_heartbeat(ids: list[str], extend_s: float, block_ids: list[list[int]]) -> None:
        asked.append(ids)

    srv = HandshakeServer("127.0.0.1", 0, "compat-test", secret=SECRET, on_heartbeat=on_heartbeat)
    srv.set_info(make_agent_info(0))
    with srv:
        reply = query_holds(Destination("127.0.0.1", srv.port, "prefill-engine", 0), ["a", "b", "c"],
                            [list(range(400_000))] * 3, "d", 5.0, secret=SECRET, timeout_s=10.0)
    assert reply.accepted == 3 and asked == [["a", "b"], ["c"]]


def test_set_info_refuses_agent_info_no_peer_would_take() -> None:
    metadata = b"m" * (m.MAX_AGENT_METADATA_BYTES + 1)
    srv = HandshakeServer("127.0.0.1", 0, "compat-test", secret=SECRET)
    with pytest.raises(MalformedMessageError) as info:
        srv.set_info(info_with(agent_metadata=metadata, metadata_digest=compute_digest(metadata)))
    assert info.value.field == "agent_metadata"
    srv.close()
