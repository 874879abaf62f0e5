"""A decode rank's push request (:class:`handshake.PushRequest`) checked on a prefill rank, in a fixed order.

Each check refuses with a message naming the field, and nothing is loaded,
pinned or queued for a refused request (:func:`check_push_request`): the
rows (``[n, 3]``, paired lengths); the agent is the requester's own
(:func:`requester_identity`) and its metadata matches its digest and names
that agent (:func:`p2pkv.dataplane.agent.check_peer_info`); every source
byte inside the held request's blocks
(:func:`p2pkv.dataplane.plan.check_rows_in_blocks`); every target byte
inside the memory the agent declares
(:func:`p2pkv.dataplane.plan.check_rows_in_regions`); the window. What needs
the rank's state (the hold itself, room for the decode rank) is checked by
:class:`p2pkv.prefill.pusher.Pusher`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from handshake import PushRequest, StreamRequest
from p2pkv.dataplane.agent import check_peer_info, is_agent_name_of
from p2pkv.dataplane.layout import KVLayout
from p2pkv.dataplane.plan import PlanError, check_block_ids, check_rows_in_blocks, check_rows_in_regions
from p2pkv.prefill.agents import Identity

ROW_BYTES = 24
"""One descriptor row on the wire: address, length, device id (three little-endian uint64)."""


@dataclass(frozen=True)
class CheckedPush:
    """A push request that passed :func:`check_push_request`.

    Attributes:
        identity: the requesting decode rank, ``(engine id, tp rank)``.
        source: this rank's rows to WRITE from, uint64 ``[n, 3]`` (address, bytes, device id).
        target: the decode rank's rows to WRITE into, uint64 ``[n, 3]``, paired row by row with ``source``.
        window_s: seconds from now within which the WRITE may start (the decode rank gives it up then).
    """

    identity: Identity
    source: np.ndarray
    target: np.ndarray
    window_s: float


def check_push_request(msg: PushRequest, layout: KVLayout, now: float) -> CheckedPush | str:
    """Check ``msg`` against this rank's KV ``layout`` (see the module docstring for the order).

    Args:
        msg: the decoded request (its fields already within the codec's bounds).
        layout: this rank's KV layout (its segments and ``num_blocks``).
        now: wall-clock seconds (``time.time()``), for the window counted from ``msg.sent_at``.

    Returns:
        The checked request, or why it is refused (naming the field).
    """
    source, target = rows_of(msg.source_rows), rows_of(msg.target_rows)
    if source is None or target is None:
        return f"source_rows/target_rows must be uint64 [n, 3] rows ({ROW_BYTES} bytes each)"
    if source.shape != target.shape or not np.array_equal(source[:, 1], target[:, 1]):
        return "source_rows and target_rows do not pair up row by row (count or lengths)"
    identity, why = requester_identity(msg)
    if identity is None:
        return why
    try:
        check_peer_info(msg.agent)
    except Exception as exc:
        return f"agent: {exc}"
    try:
        check_block_ids(msg.block_ids, layout.num_blocks, "held")
        check_rows_in_blocks(source, layout.segments, layout.num_blocks, msg.block_ids)
    except PlanError as exc:
        return f"source_rows: {exc}"
    declared = [(r.base_addr, r.length, r.device_id) for r in (*msg.agent.layout.regions, *msg.agent.staging)]
    try:
        check_rows_in_regions(target, declared)
    except PlanError as exc:
        return f"target_rows: {exc}"
    window_s = min(float(msg.window_s), msg.sent_at + msg.window_s - now)
    if window_s <= 0:  # the decode rank's wait, counted from when it sent the request, is over
        return "window_s passed before the request was handled (a busy side channel)"
    return CheckedPush(identity, source, target, window_s)


def requester_identity(msg: PushRequest | StreamRequest) -> tuple[Identity | None, str]:
    """The decode rank a push or stream request comes from, ``(engine id, rank)``, if its agent is its own.

    Its agent's ``engine_id`` must be the request's ``requester_engine_id``
    and its ``agent_name`` one p2pkv gives rank ``agent.rank`` of that
    engine (``p2pkv-<engine id>-tp<rank>-<12 hex>``), so a request loads,
    replaces and writes into only its own engine's agents.

    Returns:
        ``(identity, "")``, or ``(None, why)`` naming the field.
    """
    info = msg.agent
    if info.engine_id != msg.requester_engine_id:
        return None, (f"agent.engine_id {info.engine_id[:64]!r} is not the requester's engine id "
                      f"{msg.requester_engine_id[:64]!r}: a push writes only into the requester's own agent")
    in_range = 0 <= info.tp_rank < info.tp_size and info.pp_rank < info.pp_size
    if not in_range or not is_agent_name_of(info.agent_name, info.engine_id, info.rank):
        return None, (f"agent.agent_name {info.agent_name[:96]!r} is not the agent of rank {info.rank} (tp_rank "
                      f"{info.tp_rank} of {info.tp_size}, pp_rank {info.pp_rank} of {info.pp_size}) of engine "
                      f"{info.engine_id[:64]!r} (p2pkv-<engine id>-tp<rank>-<12 hex>): a push writes only into the "
                      "requester's own agent")
    return (info.engine_id, info.rank), ""


def rows_of(data: bytes) -> np.ndarray | None:
    """Wire rows → uint64 ``[n, 3]`` (None when the length is not a multiple of :data:`ROW_BYTES`)."""
    if len(data) % ROW_BYTES:
        return None
    return np.frombuffer(data, dtype="<u8").reshape(-1, 3).astype(np.uint64)
