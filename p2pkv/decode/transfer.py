"""One decode-side transfer: its states, and the parts it is made of.

A *transfer* (:class:`Transfer`; vLLM's scheduler calls it the request's KV
*load*, described to the workers by a :class:`p2pkv.metadata.LoadSpec`) brings
one request's prompt KV from the prefill engine into the decode engine's
blocks. It is made of one *part* per prefill rank it loads from (one when both
engines have the same TP size), each moved one way: a NIXL READ by this rank
(a *pull*), or a WRITE by the prefill rank (a *push*), by its
:class:`p2pkv.decode.movers.Mover`. The lifecycle that moves transfers between
states is :class:`p2pkv.decode.receiver.Receiver`. Settings, metrics and log
lines keep the name "pull" for a transfer of either direction (their names are
part of deployments' dashboards and configs).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from p2pkv.dataplane.agent import XferHandle
from p2pkv.dataplane.stager import Stage
from p2pkv.dataplane.topology import RankRead
from p2pkv.decode.direction import Direction
from p2pkv.decode.peers import Peer, PeerId, canonical_host
from p2pkv.metadata import LoadSpec
from p2pkv.ways import Way


class TransferState(str, enum.Enum):
    """Where a pull is. Moves only forward, except ``READING``/``FENCING`` → ``HANDSHAKE`` on a retry."""

    HANDSHAKE = "handshake"
    """Waiting for the handshake with a prefill rank it reads from or notifies."""
    STAGING = "staging"
    """Waiting for room in the staging area (pulls from peers with other block shapes)."""
    READING = "reading"
    """Parts posted (READs, or push requests); each step polls them."""
    FENCING = "fencing"
    """Every part done; waiting for the prefill ranks to confirm their leases held."""
    DONE = "done"
    """Confirmed, prefill ranks notified, reported to vLLM as received."""
    FAILED = "failed"
    """Its local blocks reported as load errors, reported to vLLM as received."""


@dataclass(eq=False)
class Part:
    """One part of a transfer: one prefill rank's share of the blocks, moved one way (its ``direction``'s
    :class:`p2pkv.decode.movers.Mover`).

    Attributes:
        transfer: the transfer it belongs to.
        attempt: the transfer's attempt this part belongs to (a retry starts a new one).
        peer_id / peer: the prefill rank it comes from.
        local_descs / remote_descs: uint64 ``[n, 3]`` ``(addr, bytes, device_id)`` rows.
        stage: staging it lands in (``STAGED`` plans), else None.
        readers: a layer stream's: how many decode ranks read its prefill rank (each sends its destination).
        head_slice: a layer stream's slice of heads, WRITTEN from each of its prefill rank's pages straight into
            this rank's (``PAGED`` plans of another TP size); None: pages whole, or into ``stage``.
        layer_groups: a layer stream's: layer index → the KV cache groups whose blocks its prefill rank WRITEs
            into that layer's pages (:attr:`p2pkv.dataplane.rank.LocalRank.layer_groups`; a layer not named:
            group 0 only).
        direction: which way it moves, once posted (None: not posted).
        live: posted and not released (NIXL releases a failed READ's handle: nothing of it is left to
            cancel or wait for); with ``done`` and ``abandoned``, whether it is in flight.
        done: ``time.monotonic()`` when seen done (0: not yet).
        abandoned: given up (its transfer failed or retried): no longer in flight, never done.
        confirmed: the prefill rank confirmed the lease held.

    The state of one way (set and read only by its mover):

    Attributes:
        handle: a READ's NIXL xfer once posted (:class:`p2pkv.decode.movers.ReadMover`).
        push_id: a push request's id (:class:`p2pkv.decode.movers.PushMover`, :mod:`p2pkv.decode.pushes`).
        pushed_at / first_pushed_at: ``time.monotonic()`` when the (first) push request was sent.
        arrived: the push's notification: True once its bytes landed, False
            when the prefill rank reported it failed; None while waiting.
        failure: why the push failed (the prefill rank's reason).

    Verified KV (:mod:`p2pkv.decode.verify`; its transfer's ``verify``):

    Attributes:
        digest: its prefill rank's digest of what it sent (None: not come yet; ``b""``: it gave none).
        landed_digest: this rank's digest of what landed, before any fixup (None: not landed yet).
    """

    transfer: Transfer
    attempt: int
    peer_id: PeerId
    peer: Peer
    local_descs: np.ndarray
    remote_descs: np.ndarray
    stage: Stage | None = None
    readers: int = 1
    head_slice: RankRead | None = None
    layer_groups: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    direction: Direction | None = None
    live: bool = False
    handle: XferHandle | None = None
    done: float = 0.0
    abandoned: bool = False
    confirmed: bool = False
    push_id: bytes = b""
    pushed_at: float = 0.0
    first_pushed_at: float = 0.0
    arrived: bool | None = None
    failure: str = ""
    digest: bytes | None = None
    landed_digest: bytes | None = None

    @property
    def in_flight(self) -> bool:
        """Posted, not ended in NIXL's or the prefill rank's word, not yet seen done, not given up."""
        return self.live and not self.done and not self.abandoned

    @property
    def num_bytes(self) -> int:
        """Bytes it moves (its descriptors' lengths)."""
        return int(self.local_descs[:, 1].sum())


@dataclass(eq=False)
class Transfer:
    """One request's transfer (its parts read or pushed).

    Attributes:
        spec: what to load (from the scheduler; its host canonical, see
            :func:`p2pkv.decode.peers.canonical_host`).
        started: ``time.monotonic()`` of the current attempt's first READ.
        state: where it is (:class:`TransferState`).
        since: ``time.monotonic()`` when it entered ``state`` (its deadline
            counts from there, :mod:`p2pkv.decode.deadlines`).
        peers: every prefill rank it reads from or notifies (while it is under
            way, none of them is evicted).
        attempt: 0 for the first try, 1 after the one retry a peer failure allows.
        parts: the current attempt's parts (READ or pushed), one per prefill rank it loads from (several
            when one is longer than a push request carries: :meth:`p2pkv.decode.movers.Mover.split`).
        notify: prefill ranks to notify when done, each with how many decode
            ranks notify it.
        num_bytes / num_descriptors: moved so far by the current attempt.
        draining: cancelled READs NIXL would not release yet; a failed transfer is
            reported (its blocks handed back to vLLM) only once they have ended.
        marks: wall-clock times (``time.time()`` seconds) of its phases' ends
            (see :meth:`p2pkv.telemetry.stats.StatsBuffer.record_phases`).
        questions: its fence questions and their answers, each with when it was
            queued on its lane, left, and was answered (or given up on),
            ``time.time()`` seconds (:meth:`p2pkv.decode.fence.Fence.answers`).
        given_up: its request ended while it ran (a layer stream given up): it ends ``FAILED`` but is reported
            finished with no load errors.
        verify: every part is checked against its prefill rank's digest before the load is handed to vLLM
            (``verify_kv``, where its way is verified: :mod:`p2pkv.decode.verify`).
    """

    spec: LoadSpec
    started: float = 0.0
    state: TransferState = TransferState.HANDSHAKE
    since: float = field(default_factory=time.monotonic)
    peers: tuple[PeerId, ...] = ()
    attempt: int = 0
    parts: list[Part] = field(default_factory=list)
    notify: list[tuple[PeerId, int]] = field(default_factory=list)
    num_bytes: int = 0
    num_descriptors: int = 0
    draining: int = 0
    marks: dict[str, float] = field(default_factory=dict)
    questions: list[dict[str, Any]] = field(default_factory=list)
    given_up: bool = False
    verify: bool = False

    @classmethod
    def taken(cls, spec: LoadSpec, verify: bool = False) -> Transfer:
        """A new pull of ``spec``, taken by the worker now (its first phase marks set, its host canonical);
        ``verify``: ``verify_kv`` is on (its parts are checked where its way is verified)."""
        remote = dataclasses.replace(spec.remote, host=canonical_host(spec.remote.host))
        return cls(dataclasses.replace(spec, remote=remote), verify=verify and way_of(spec).verified,
                   marks={"arrival": spec.arrival, "scheduled": spec.scheduled, "taken": time.time()})

    @property
    def request_id(self) -> str:
        """The decode engine's request id."""
        return self.spec.request_id

    @property
    def finished(self) -> bool:
        """True once ``DONE`` or ``FAILED``."""
        return self.state in (TransferState.DONE, TransferState.FAILED)

    @property
    def failed(self) -> bool:
        """True once ``FAILED``."""
        return self.state is TransferState.FAILED

    @property
    def fixed(self) -> Direction | None:
        """The way its load fixes for every part (:attr:`p2pkv.metadata.LoadSpec.way`), or None: each part
        moves the way chosen for its prefill rank (:class:`p2pkv.decode.direction.Directions`)."""
        return fixed_direction(self.spec)

    @property
    def way(self) -> Way:
        """What the way says of the transfer as a whole (:func:`way_of`)."""
        return way_of(self.spec)

    def direction(self) -> Direction:
        """How its bytes moved, for metrics and spans: its first posted part's direction (its parts share
        one, except under ``transfer_mode`` auto while a peer's choice changes); pull before any is posted."""
        return next((r.direction for r in self.parts if r.direction is not None), Direction.PULL)


def fixed_direction(spec: LoadSpec) -> Direction | None:
    """The direction a load of ``spec`` fixes for every part (:attr:`p2pkv.metadata.LoadSpec.way`), or None."""
    return Direction(spec.way) if spec.way else None


def way_of(spec: LoadSpec) -> Way:
    """What the way says of a load of ``spec`` as a whole, before or after its parts are posted: its fixed way's,
    else pull's, since the ways its parts may then be chosen (pull, push) agree on every trait asked of a whole
    transfer (``tests/test_ways.py``)."""
    return (fixed_direction(spec) or Direction.PULL).way


STREAM_POLL_MIN_S = 0.001
"""Shortest poll interval (seconds) of a decode worker's pulls' thread while every pull under way is a layer
stream waiting for its prefill (then :data:`STREAM_POLL_SHARE` of the wait so far, at most
:data:`STREAM_POLL_MAX_S`). Polling such a wait as fast as a READ (:data:`p2pkv.decode.progress.INTERVAL_S`),
with the idle steps, kept 0.55-0.65 of a core busy for the prefill's whole forward on a 2-core CPU host that ran
both engines (docs/streaming.md)."""

STREAM_POLL_SHARE = 0.01
"""While every pull is a layer stream waiting for its prefill, the pulls' thread polls every this share of the
time the youngest stream has waited so far (at least :data:`STREAM_POLL_MIN_S`, at most
:data:`STREAM_POLL_MAX_S`): the notification is seen at most 1 % of the stream's time late, and a prefill of
seconds is polled a hundred times a second, not a thousand (on a CPU host each poll takes the prefill's cores)."""

STREAM_POLL_MAX_S = 0.01
"""Longest poll interval (seconds) of a stream wait, however long it has waited."""


def stream_poll_interval(transfers: list[Transfer], now: float, floor_s: float) -> float:
    """Seconds until the pulls' thread polls ``transfers`` again while :func:`streams_only` holds: the share
    :data:`STREAM_POLL_SHARE` of the youngest one's wait so far (``now - started``, ``time.monotonic()``
    seconds), within ``floor_s`` (:data:`STREAM_POLL_MIN_S`) .. :data:`STREAM_POLL_MAX_S`."""
    waited = min((now - t.started for t in transfers), default=0.0)
    return max(floor_s, min(STREAM_POLL_MAX_S, STREAM_POLL_SHARE * waited))


def poll_wait_s(transfers: list[Transfer], now: float, pull_s: float, stream_s: float) -> float:
    """Seconds until the pulls' thread polls ``transfers`` again: ``pull_s`` (:data:`p2pkv.decode.progress.INTERVAL_S`),
    or :func:`stream_poll_interval` from ``stream_s`` (:data:`STREAM_POLL_MIN_S`) while :func:`streams_only`."""
    return stream_poll_interval(transfers, now, stream_s) if streams_only(transfers) else pull_s


def streams_only(transfers: list[Transfer]) -> bool:
    """True while every pull under way is a layer stream waiting for its prefill's notification (none: False).

    Such a wait lasts the prefill's whole forward, so the decode rank polls it
    and steps idle more slowly (:data:`STREAM_POLL_MIN_S`, :data:`p2pkv.worker.STREAM_IDLE_WAIT_S`):
    polling it as fast as a READ kept most of a core busy for that long.
    """
    return bool(transfers) and all(t.state is TransferState.READING and t.direction().way.lasts_prefill
                                   for t in transfers)
