"""Who moves a part's bytes, and how: one :class:`Mover` per :class:`~p2pkv.decode.direction.Direction`.

A pull is made of parts, one per prefill rank (:class:`p2pkv.decode.transfer.Part`; a mover may cut one
into several it moves apart, :meth:`Mover.split`).
Each part is moved one way, chosen when it starts
(:class:`p2pkv.decode.direction.Directions`): this rank READs it
(:class:`ReadMover`), or asks its prefill rank to WRITE it
(:class:`PushMover`). Everything that differs between the ways lives in the
part's mover: posting, whether it is still in flight, polling, what follows
when its bytes landed (a fence question after a READ; nothing after a push,
whose prefill rank kept the hold until its WRITE ended), giving it up (a READ
is cancelled, a push drains until its window has passed), whether it has
ended, and whether a failure says its peer is gone. The lifecycle around
them (:class:`p2pkv.decode.receiver.Receiver`, :mod:`p2pkv.decode.drain`,
:mod:`p2pkv.decode.reads`) never asks which way a part moves.

How a transfer's parts are planned is its mover's too (:meth:`Mover.plan`):
rows for a READ or a push (:func:`p2pkv.decode.reads.plan_reads`), one part
per prefill rank with no rows for a layer stream
(:func:`p2pkv.decode.stream_parts.plan_streams`), which also sends its
request (:func:`p2pkv.decode.stream_parts.post_stream`).

A new way is its :class:`p2pkv.ways.Way` (which names its mover class here),
a :class:`~p2pkv.decode.direction.Direction` value, a new :class:`Mover` and
its constructor in :func:`movers`; the other files it touches are listed in
:mod:`p2pkv.ways`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from handshake.messages import MAX_PUSH_ROWS
from p2pkv.decode.direction import Direction
from p2pkv.decode.fence import Fence, Phase
from p2pkv.decode.reads import ReadEvent, land, plan_reads, release_stage
from p2pkv.decode.stream_parts import plan_streams, post_stream

if TYPE_CHECKING:
    from p2pkv.dataplane.agent import NixlTransferAgent
    from p2pkv.dataplane.rank import LocalRank
    from p2pkv.dataplane.stager import Stager
    from p2pkv.dataplane.topology import RankRead
    from p2pkv.decode.peers import Peer, PeerId
    from p2pkv.decode.pushes import Pushes
    from p2pkv.decode.transfer import Part, Transfer
    from p2pkv.faults import Faults


class Mover(ABC):
    """How the parts of one direction move.

    Attributes:
        direction: the direction it moves parts in (the metric and span label).
        keeps_peer_on_failure: a failure comes from a prefill rank that is
            alive (it said so): keep the peer and its queued notifications
            instead of dropping it and handshaking again.
        fallback: the direction that moves a part this mover cannot carry
            (:meth:`cannot_carry`); None: it carries every part.
        ended_frees_staging: :meth:`ended` proves that nothing more lands in a given-up part's staging (a
            push's notification or refusal), so that staging goes back then, not after a quarantine of the
            part's whole window.
    """

    direction: Direction
    keeps_peer_on_failure: bool = False
    fallback: Direction | None = None
    ended_frees_staging: bool = False
    stager: Stager

    def plan(self, transfer: Transfer, reads: list[RankRead], notify: list[int], rank: LocalRank,
             peers: dict[PeerId, Peer]) -> tuple[bool, list[int]]:
        """Put ``transfer``'s parts in ``transfer.parts``: one per prefill rank of ``reads`` with something to
        load, as descriptor rows (a READ's, or a push request's: the same rows).

        Args:
            transfer: a transfer whose parts this way plans (its fixed way's mover, or pull's).
            reads: the prefill ranks this rank reads, with head slices.
            notify: the prefill ranks this rank answers for.
            rank: this rank.
            peers: the handshaken prefill ranks.

        Returns:
            ``(planned, release)``: False when staging has no room yet (nothing stays reserved), and the
            prefill ranks of ``notify`` to tell at once that this load takes nothing from them.

        Raises:
            p2pkv.dataplane.plan.PlanError: bad block ids.
            p2pkv.dataplane.staging.StagingFull: the transfer can never fit in staging.
        """
        planned = plan_reads(transfer, [r.remote_rank for r in reads], peers, rank.layout, rank.desc,
                             rank.device_id, self.stager)
        return planned, []

    def cannot_carry(self, part: Part) -> str | None:
        """Why this way cannot move ``part`` at all (then its :attr:`fallback` does), or None when it can."""
        return None

    def split(self, part: Part) -> list[Part]:
        """``part`` as the parts this way moves it in (itself, unless it is longer than one move carries)."""
        return [part]

    @abstractmethod
    def post(self, part: Part) -> None:
        """Start moving ``part``.

        Raises:
            Exception: it could not start (NIXL refused the READ, or the push request could not be built).
        """

    @abstractmethod
    def polled_soon(self, part: Part) -> bool:
        """True when ``part`` in flight should be polled again soon from the pulls' thread."""

    @abstractmethod
    def poll(self, part: Part, now: float) -> tuple[ReadEvent, Exception | None]:
        """Poll ``part`` in flight at ``now`` (``time.monotonic()`` seconds); the event and, if it failed, why."""

    @abstractmethod
    def landed(self, part: Part) -> None:
        """``part``'s bytes have landed: start what confirms it (or confirm it)."""

    @abstractmethod
    def give_up(self, part: Part, now: float) -> tuple[float | None, float]:
        """Stop waiting for ``part`` (in flight) at ``now``.

        Returns:
            ``(deadline, quarantine_s)``: the ``time.monotonic()`` until which
            it may still write into our memory (None: it ended here), and how
            long its staging, if any, must stay unused (seconds).
        """

    @abstractmethod
    def ended(self, part: Part) -> bool:
        """True once ``part``, given up, can write nothing more."""

    def stop(self, part: Part) -> None:  # noqa: B027 - nothing to do for most ways
        """The rank is shutting down: end what can be ended of ``part`` (no waiting)."""


class ReadMover(Mover):
    """This rank READs the part (pull): posted and polled in NIXL; fenced before and after.

    Args:
        agent: the rank's NIXL agent.
        stager: the staging area (a staged part is fixed up when it lands).
        fence: where the READ's questions go.
        quarantine_s: how long a cancelled READ NIXL kept may still land (seconds).
    """

    direction = Direction.PULL

    def __init__(self, agent: NixlTransferAgent, stager: Stager, fence: Fence, quarantine_s: float,
                 faults: Faults | None = None) -> None:
        self.agent = agent
        self.stager = stager
        self.fence = fence
        self.quarantine_s = quarantine_s
        self.faults = faults
        self._held_back: dict[int, float] = {}
        """``id(part)`` → ``time.monotonic()`` until which a landed READ is reported in flight (``delay_read``)."""

    def post(self, part: Part) -> None:
        local, remote = part.local_descs, part.remote_descs
        if self.faults is not None:  # an operator's injected fault may drop most of the READ
            local, remote = self.faults.read_rows(local, remote, part.transfer.request_id)
        part.handle = self.agent.start_read(part.peer.agent_name, local, remote)
        self.fence.add(part, Phase.BEFORE)

    def polled_soon(self, part: Part) -> bool:
        return part.stage is None  # a staged READ's fixup runs at the engine step

    def poll(self, part: Part, now: float) -> tuple[ReadEvent, Exception | None]:
        try:
            done = self.agent.poll(part.handle)
        except Exception as exc:
            part.handle, part.live = None, False  # NIXL released it
            release_stage(self.stager, part)
            return ReadEvent.FAILED, exc
        if not done or self._delayed(part, now):
            return ReadEvent.IN_FLIGHT, None
        return land(self.stager, part, now, part.handle.num_bytes, part.handle.num_descriptors, self.faults)

    def _delayed(self, part: Part, now: float) -> bool:
        """Whether ``part``'s landed READ is still held back by an injected ``delay_read`` (drawn once, when it
        is first seen landed)."""
        if self.faults is None or not self.faults.delay_read:
            return False
        until = self._held_back.get(id(part))
        if until is None:
            delay = self.faults.delay(part.transfer.request_id)
            if not delay:
                return False
            until = self._held_back[id(part)] = now + delay
        if now < until:
            return True
        del self._held_back[id(part)]
        return False

    def landed(self, part: Part) -> None:
        self.fence.add(part, Phase.AFTER)

    def give_up(self, part: Part, now: float) -> tuple[float | None, float]:
        self._held_back.pop(id(part), None)
        if self.agent.cancel(part.handle):
            return None, self.quarantine_s
        return now + self.quarantine_s, self.quarantine_s

    def ended(self, part: Part) -> bool:
        try:
            return self.agent.poll(part.handle)
        except Exception:
            return True

    def stop(self, part: Part) -> None:
        self._held_back.pop(id(part), None)
        self.agent.cancel(part.handle)


class PushMover(Mover):
    """The prefill rank WRITEs the part when asked (push): no NIXL handle here, its notification says when
    the bytes landed; confirmed then (the prefill rank kept the hold until its WRITE ended).

    Args:
        pushes: where the push request goes and its notification comes from.
        stager: the staging area (a staged part is fixed up when it lands).
    """

    direction = Direction.PUSH
    keeps_peer_on_failure = True  # a failed push is reported by a live prefill rank
    fallback = Direction.PULL
    ended_frees_staging = True  # the prefill rank notifies only once no WRITE of it is in flight

    def __init__(self, pushes: Pushes, stager: Stager, faults: Faults | None = None) -> None:
        self.pushes = pushes
        self.stager = stager
        self.faults = faults

    def cannot_carry(self, part: Part) -> str | None:
        rows = int(part.remote_descs.shape[0])
        if rows > MAX_PUSH_ROWS and part.stage is not None:
            return (f"{rows} descriptor rows into staging are more than one push request carries "
                    f"({MAX_PUSH_ROWS}: handshake.MAX_PUSH_ROWS), and a staged part is fixed up whole")
        return None

    def split(self, part: Part) -> list[Part]:
        """A part into local blocks with more rows than one push request carries (``MAX_PUSH_ROWS``): one part
        per request, each its slice of the rows (a staged part stays whole: :meth:`cannot_carry`)."""
        rows = int(part.remote_descs.shape[0])
        if rows <= MAX_PUSH_ROWS or part.stage is not None:
            return [part]
        return [dataclasses.replace(part, local_descs=part.local_descs[i:i + MAX_PUSH_ROWS],
                                    remote_descs=part.remote_descs[i:i + MAX_PUSH_ROWS])
                for i in range(0, rows, MAX_PUSH_ROWS)]

    def post(self, part: Part) -> None:
        self.pushes.post(part)

    def polled_soon(self, part: Part) -> bool:
        return True

    def poll(self, part: Part, now: float) -> tuple[ReadEvent, Exception | None]:
        if part.arrived is None:
            return ReadEvent.IN_FLIGHT, None
        if not part.arrived:
            release_stage(self.stager, part)
            return ReadEvent.FAILED, RuntimeError(part.failure or "the prefill rank's WRITE failed")
        return land(self.stager, part, now, part.num_bytes, int(part.local_descs.shape[0]), self.faults)

    def landed(self, part: Part) -> None:
        part.confirmed = True

    def give_up(self, part: Part, now: float) -> tuple[float | None, float]:
        if not self.pushes.ended(part) and not self.pushes.agent.reachable(part.peer.agent_name):
            self.pushes.forget(part)  # its process is gone: none of its WRITEs can land (asked while still loaded)
        if self.pushes.ended(part):
            return None, 0.0
        deadline = self.pushes.drain_deadline(part)
        return deadline, max(0.0, deadline - now)

    def ended(self, part: Part) -> bool:
        return self.pushes.ended(part)


class StreamMover(PushMover):
    """The prefill rank WRITEs each layer of the part as its forward computes it (a layer-streamed load): the
    request carries this rank's blocks and the grant instead of rows (the prefill rank plans them, as it
    learns its own blocks step by step); everything after is a push's (its "pushed" notification)."""

    direction = Direction.STREAM
    fallback = None

    def cannot_carry(self, part: Part) -> str | None:
        return None

    def split(self, part: Part) -> list[Part]:
        return [part]

    def plan(self, transfer: Transfer, reads: list[RankRead], notify: list[int], rank: LocalRank,
             peers: dict[PeerId, Peer]) -> tuple[bool, list[int]]:
        """One part per prefill rank read, with no rows (:func:`p2pkv.decode.stream_parts.plan_streams`); the
        ranks this rank answers for but reads nothing from are told at once, since their streams have no
        destination."""
        read = sorted({r.remote_rank for r in reads})
        planned = plan_streams(transfer, read, rank.notifiers(transfer.spec.remote.tp_size, read), peers, rank,
                               self.stager)
        return planned, sorted(set(notify) - set(read)) if planned else []

    def post(self, part: Part) -> None:
        post_stream(self.pushes, part)


def movers(agent: NixlTransferAgent, stager: Stager, fence: Fence, pushes: Pushes,
           quarantine_s: float, faults: Faults | None = None) -> dict[Direction, Mover]:
    """The mover of each direction for one decode rank: the class :data:`p2pkv.ways.WAYS` names for its way
    (``faults``: an operator's injected faults, :mod:`p2pkv.faults`, applied where parts land with rows); a request
    ``pushes`` sends again goes by its way's mover (:attr:`p2pkv.decode.pushes.Pushes.posters`)."""
    made = {ReadMover: lambda: ReadMover(agent, stager, fence, quarantine_s, faults),
            PushMover: lambda: PushMover(pushes, stager, faults),
            StreamMover: lambda: StreamMover(pushes, stager, faults)}
    by_name = {cls.__name__: make for cls, make in made.items()}
    ways = {direction: by_name[direction.way.mover]() for direction in Direction}
    pushes.posters = {d.value: m.post for d, m in ways.items() if isinstance(m, PushMover)}  # asked again
    return ways
