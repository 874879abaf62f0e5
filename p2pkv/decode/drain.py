"""Parts of given-up pulls that may still write into local blocks, waited out before vLLM gets the blocks back.

A failed pull's parts in flight are given up (:meth:`Drain.abandon`, each
by its mover): NIXL refuses to release a READ still active, whose bytes
may still land, and a push the prefill rank accepted cannot be cancelled from
here at all. Such parts *drain*: the pull is reported to vLLM (its blocks
handed back) only once each has ended in its mover's word
(:meth:`p2pkv.decode.movers.Mover.ended`: the READ done or failed, the push
notified or refused) or its deadline passed (``transfer_timeout_s`` after
the cancel; a push's window, :meth:`p2pkv.decode.pushes.Pushes.drain_deadline`).
"""

from __future__ import annotations

import time

from p2pkv.dataplane.stager import Stager
from p2pkv.decode.direction import Direction
from p2pkv.decode.movers import Mover
from p2pkv.decode.outcomes import Outcomes
from p2pkv.decode.peers import PeerId
from p2pkv.decode.reads import release_unposted
from p2pkv.decode.transfer import Part, Transfer


class Drain:
    """The parts still draining on one decode rank.

    Args:
        stager: the staging area (a given-up part's staging is quarantined).
        outcomes: where a pull goes once its last part has drained.
        movers: the mover of each direction.
    """

    def __init__(self, stager: Stager, outcomes: Outcomes, movers: dict[Direction, Mover]) -> None:
        self.stager = stager
        self.outcomes = outcomes
        self.movers = movers
        self._parts: list[tuple[Part, float]] = []  # part, time.monotonic() deadline

    def abandon(self, transfer: Transfer) -> None:
        """Give up ``pull``'s parts in flight and start its next attempt (late fence answers are then ignored).

        Each part's mover gives it up (:meth:`p2pkv.decode.movers.Mover.give_up`):
        a READ NIXL cancels has ended; one it would not cancel, and a push (its
        prefill rank may still WRITE until its window has passed), drain until
        they end or their deadline passes. The staging of a part given up is
        quarantined for as long as its mover says it may still land, or, where
        its end proves that nothing more lands (a push's word:
        :attr:`p2pkv.decode.movers.Mover.ended_frees_staging`), kept until it
        drained; unposted staging is given back.
        """
        for read in transfer.parts:
            if not read.in_flight or read.direction is None:
                continue
            mover = self.movers[read.direction]
            deadline, quarantine = mover.give_up(read, time.monotonic())
            if deadline is not None:
                transfer.draining += 1
                self._parts.append((read, deadline))
            read.abandoned = True
            if read.stage is not None and not (deadline is not None and mover.ended_frees_staging):
                self.stager.quarantine(read.stage, quarantine)
                read.stage = None
        release_unposted(transfer, self.stager)
        transfer.attempt += 1

    def poll(self) -> None:
        """Report the pulls whose last draining part has ended (or passed its deadline)."""
        now, keep = time.monotonic(), []
        for read, deadline in self._parts:
            if not self._ended(read) and now < deadline:
                keep.append((read, deadline))
                continue
            read.transfer.draining -= 1
            if read.stage is not None:  # kept while it drained (ended_frees_staging): nothing more lands
                self.stager.release(read.stage)
                read.stage = None
            if read.transfer.finished and not read.transfer.draining:
                self.outcomes.report(read.transfer)
        self._parts = keep

    def _ended(self, read: Part) -> bool:
        """True once a given-up part can write nothing more."""
        return read.direction is None or self.movers[read.direction].ended(read)

    def uses(self, agent_name: str) -> bool:
        """Whether a part of prefill agent ``agent_name`` still drains."""
        return any(read.peer.agent_name == agent_name for read, _ in self._parts)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def peers(self) -> set[PeerId]:
        """The prefill ranks of the parts draining (never dropped meanwhile)."""
        return {read.peer_id for read, _ in self._parts}
