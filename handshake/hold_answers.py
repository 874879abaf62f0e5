"""A prefill worker's answers to hold requests: lease heartbeats, fence questions and releases.

The server (:class:`handshake.server.HandshakeServer`) checks a request's
authenticity, destination and freshness; :class:`HoldAnswers` then hands it to
the prefill worker's callbacks and builds the :class:`~handshake.messages.HoldsReply`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from handshake.errors import MalformedMessageError
from handshake.messages import (
    PROTOCOL_VERSION,
    HoldQuery,
    HoldRequest,
    HoldsReply,
    LeaseHeartbeat,
    PushRequest,
    PushStatus,
    ReleaseHolds,
    StreamRequest,
)

__all__ = ["HoldAnswers", "HoldStatus", "OnDigest", "OnPush", "OnStream"]


@dataclass(frozen=True)
class HoldStatus:
    """What a prefill worker says of the request ids of a hold request (the rest are held).

    Attributes:
        expired: lease ran out (blocks may have been reused).
        not_held: released already, or the hold lacks the asked-for block ids.
        unknown: never told to hold them (yet).
    """

    expired: list[str] = field(default_factory=list)
    not_held: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


OnHeartbeat = Callable[[list[str], float, list[list[int]]], HoldStatus | None]
"""(request ids, lease length in seconds, block ids per id or ``[]``) → what is not held (None: all held)."""
OnRelease = Callable[[list[str], list[list[int]], str], int]
"""(request ids, block ids per id, the requester's ``requester_engine_id``) → how many holds with exactly those
block ids (or streams) are released."""
OnPush = Callable[[PushRequest], tuple[PushStatus, str]]
"""A push request → ``(status, message)``: queued (``accepted``) or why not."""

OnStream = Callable[[StreamRequest], tuple[PushStatus, str]]
"""A stream request → ``(status, message)``: its destination taken (``accepted``) or why not."""

OnDigest = Callable[[str, list[int], bytes], bytes]
"""(request id, block ids, :data:`~handshake.messages.Rows`) → the digest of those rows of that hold (``b""``:
not held with those blocks, rows outside them, or memory it cannot digest). Verified KV."""


class HoldAnswers:
    """Answers hold requests with a prefill worker's callbacks.

    Args:
        on_heartbeat: takes :class:`~handshake.messages.LeaseHeartbeat` (no
            block ids) and :class:`~handshake.messages.HoldQuery`; None: this
            side holds nothing and refuses them.
        on_release: takes :class:`~handshake.messages.ReleaseHolds`; None: refused.
        stats: counters ``"heartbeats"``, ``"releases"`` and ``"digests"`` are added to it.
        on_digest: digests the rows of a :class:`~handshake.messages.HoldQuery`'s ``digest_rows`` (held ids
            only, after ``on_heartbeat``); None: every digest answered ``b""`` (the asker fails its load closed).
    """

    def __init__(self, on_heartbeat: OnHeartbeat | None, on_release: OnRelease | None, stats: dict[str, int],
                 on_digest: OnDigest | None = None) -> None:
        self._on_heartbeat = on_heartbeat
        self._on_release = on_release
        self._stats = stats
        self._on_digest = on_digest

    def answer(self, msg: HoldRequest) -> HoldsReply:
        """The reply to ``msg`` (its ids and nonce echoed).

        Raises:
            MalformedMessageError: no callback for it (this side holds no
                requests), or ``block_ids`` has not one list per request id.
        """
        ids = list(msg.request_ids)
        status, accepted = HoldStatus(), len(ids)
        digests: list[bytes] = []
        match msg:
            case ReleaseHolds():
                if self._on_release is None:
                    raise _no_holds(msg)
                _same_length(msg.block_ids, ids)
                accepted = self._on_release(ids, [list(b) for b in msg.block_ids], msg.requester_engine_id)
                self._count("releases")
            case LeaseHeartbeat() | HoldQuery():
                if self._on_heartbeat is None:
                    raise _no_holds(msg)
                blocks: list[list[int]] = []
                if isinstance(msg, HoldQuery):
                    _same_length(msg.block_ids, ids)
                    blocks = [list(b) for b in msg.block_ids]
                status = self._on_heartbeat(ids, float(msg.extend_s), blocks) or status
                self._count("heartbeats")
                if isinstance(msg, HoldQuery) and msg.digest_rows:
                    digests = self._digests(msg, ids, blocks, status)
        return HoldsReply(protocol_version=PROTOCOL_VERSION, accepted=accepted, expired=status.expired,
                          not_held=status.not_held, unknown=status.unknown, request_ids=ids, nonce=msg.nonce,
                          digests=digests)

    def _digests(self, msg: HoldQuery, ids: list[str], blocks: list[list[int]], status: HoldStatus) -> list[bytes]:
        """One digest per id of ``msg``: its rows' (``on_digest``) where held and asked, ``b""`` otherwise.

        Raises:
            MalformedMessageError: ``digest_rows`` has not one entry per request id.
        """
        if len(msg.digest_rows) != len(ids):
            raise MalformedMessageError(f"digest_rows has {len(msg.digest_rows)} entries for {len(ids)} request ids",
                                        field="digest_rows")
        ended = {*status.expired, *status.not_held, *status.unknown}
        out = []
        for request_id, block_ids, rows in zip(ids, blocks, msg.digest_rows, strict=True):
            asked = bool(rows) and request_id not in ended and self._on_digest is not None
            if not asked:
                out.append(b"")
                continue
            assert self._on_digest is not None
            out.append(self._on_digest(request_id, block_ids, rows))
            self._count("digests")
        return out

    def _count(self, key: str) -> None:
        self._stats[key] = self._stats.get(key, 0) + 1


def _same_length(block_ids: list[list[int]], ids: list[str]) -> None:
    if len(block_ids) != len(ids):
        raise MalformedMessageError(f"block_ids has {len(block_ids)} lists for {len(ids)} request ids",
                                    field="block_ids")


def _no_holds(msg: HoldRequest) -> MalformedMessageError:
    return MalformedMessageError(
        f"this server holds no requests ({msg.__struct_config__.tag} is for prefill workers); "
        "send it to the prefill engine's side channel", field="type")
