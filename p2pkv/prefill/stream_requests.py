"""A decode rank's stream request (:class:`handshake.StreamRequest`) checked on a prefill rank, in a fixed order.

Each check refuses with a message naming the field, and nothing is loaded
or kept for a refused request (:func:`check_stream_request`): the rank can
stream at all (its pages cut one per layer, a secret to check grants); the
agent is the requester's own (:func:`p2pkv.prefill.push_requests.requester_identity`);
the grant names this engine and the requester (or any decode engine) and
has not expired; the agent's metadata is well formed and its pages are this
rank's (same page size, layer and K/V order: a stream moves pages as they
are); its block ids lie in its cache; the request's window has not passed.
What needs the rank's state (a stream id served once, room for pending
destinations) is checked by :class:`p2pkv.prefill.streams.PrefillStreams`.
"""

from __future__ import annotations

from dataclasses import dataclass

from handshake import KVLayoutDesc, StreamRequest
from p2pkv.dataplane.agent import check_peer_info
from p2pkv.dataplane.layers import page_segments
from p2pkv.dataplane.layout import LayoutError
from p2pkv.dataplane.negotiate import page_bytes, remote_segments
from p2pkv.dataplane.plan import PlanError, check_block_ids
from p2pkv.grant import StreamGrant, StreamGrantError, check_stream_grant
from p2pkv.prefill.agents import Identity
from p2pkv.prefill.push_requests import requester_identity
from p2pkv.prefill.streamer import StreamSide


def stream_side(desc: KVLayoutDesc) -> StreamSide:
    """A rank's :class:`StreamSide` from its :class:`handshake.KVLayoutDesc`.

    Raises:
        LayoutError: its pages cannot be cut one per layer (an interleaved layout).
    """
    pages = page_segments(remote_segments(desc), page_bytes(desc))
    return StreamSide(tuple(pages), desc.num_blocks, desc.regions[0].device_id if desc.regions else 0)


@dataclass(frozen=True)
class CheckedStream:
    """A stream request that passed :func:`check_stream_request`.

    Attributes:
        identity: the requesting decode rank, ``(engine id, tp rank)``.
        grant: its checked grant.
        side: the decode rank's memory as the stream moves it.
        window_s: seconds from now within which the stream must end (the decode rank gives it up then).
    """

    identity: Identity
    grant: StreamGrant
    side: StreamSide
    window_s: float


def check_stream_request(msg: StreamRequest, source: StreamSide | str, secret: bytes | None, engine_id: str,
                         now: float) -> CheckedStream | str:
    """Check ``msg`` against this rank (see the module docstring for the order).

    Args:
        msg: the request, as the side channel decoded it (every field the sender's choice).
        source: this rank's pages, or why it cannot stream.
        secret: checks the grant (None: this rank streams nothing).
        engine_id: this engine's id (the grant must name it).
        now: ``time.time()`` seconds (the grant's expiry and the request's window).

    Returns:
        The checked request, or why it is refused (a message naming the field).
    """
    if isinstance(source, str) or not secret:
        return source if isinstance(source, str) else "this engine runs without a secret"
    identity, why = requester_identity(msg)
    if identity is None:
        return why
    try:
        grant = check_stream_grant(msg.grant, secret, prefill_engine_id=engine_id,
                                   decode_engine_id=msg.requester_engine_id, now=now)
    except StreamGrantError as exc:
        return str(exc)
    try:
        check_peer_info(msg.agent)
        side = stream_side(msg.agent.layout)
    except LayoutError as exc:
        return f"agent.layout: {exc}"
    except Exception as exc:
        return f"agent: {exc}"
    if (why := pages_differ(source, side)) is not None:
        return why
    try:
        check_block_ids(msg.block_ids, side.num_blocks, "decode")
    except PlanError as exc:
        return f"block_ids: {exc}"
    window_s = min(float(msg.window_s), msg.sent_at + msg.window_s - now)
    if window_s <= 0:
        return "window_s passed before the request was handled (a busy side channel)"
    return CheckedStream(identity, grant, side, window_s)


def pages_differ(ours: StreamSide, theirs: StreamSide) -> str | None:
    """Why a decode rank's pages cannot take this rank's as they are (count, size, layer or K/V order), or None."""
    mine = [(p.length, p.layer_start, p.kv_index) for p in ours.pages]
    if mine != [(p.length, p.layer_start, p.kv_index) for p in theirs.pages]:
        return (f"the decode rank's {len(theirs.pages)} pages per block differ from this rank's {len(mine)} "
                "(page size, layer or K/V order): stream only between engines with the same block size, "
                "page order and heads per rank; send such pairs without a grant (push)")
    return None
