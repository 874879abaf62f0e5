"""Parts of given-up pulls that may still write into local blocks, waited out before vLLM gets the blocks back.

A failed pull's READs are cancelled (:func:`p2pkv.decode.reads.abandon`);
NIXL refuses to release one still active, whose bytes may still land, and a
push the prefill rank accepted cannot be cancelled from here at all. Such
parts *drain*: the pull is reported to vLLM (its blocks handed back) only
once each has ended — the READ done or failed, the push notified or refused
— or its deadline passed (``transfer_timeout_s`` after the cancel; a push's
window, :meth:`p2pkv.decode.pushes.Pushes.drain_deadline`).
"""

from __future__ import annotations

import time

from p2pkv.dataplane.agent import NixlTransferAgent
from p2pkv.dataplane.stager import Stager
from p2pkv.decode.outcomes import Outcomes
from p2pkv.decode.peers import PeerId
from p2pkv.decode.pull import Pull, ReadPart
from p2pkv.decode.pushes import Pushes
from p2pkv.decode.reads import abandon


class Drain:
    """The parts still draining on one decode rank.

    Args:
        agent: the rank's NIXL agent (READs are polled there).
        stager: the staging area (a cancelled part's staging is quarantined).
        pushes: the rank's push requests (whether one has ended).
        outcomes: where a pull goes once its last part has drained.
        quarantine_s: how long a cancelled READ NIXL kept may still land (seconds).
    """

    def __init__(self, agent: NixlTransferAgent, stager: Stager, pushes: Pushes, outcomes: Outcomes,
                 quarantine_s: float) -> None:
        self.agent = agent
        self.stager = stager
        self.pushes = pushes
        self.outcomes = outcomes
        self.quarantine_s = quarantine_s
        self._parts: list[tuple[ReadPart, float]] = []  # part, time.monotonic() deadline

    def abandon(self, pull: Pull) -> None:
        """Give up ``pull``'s parts in flight and start its next attempt; those that may still write drain."""
        self._parts += abandon(pull, self.agent, self.stager, self.quarantine_s, self.pushes.drain_deadline)

    def poll(self) -> None:
        """Report the pulls whose last draining part has ended (or passed its deadline)."""
        now, keep = time.monotonic(), []
        for read, deadline in self._parts:
            if not self._ended(read) and now < deadline:
                keep.append((read, deadline))
                continue
            read.pull.draining -= 1
            if read.pull.finished and not read.pull.draining:
                self.outcomes.report(read.pull)
        self._parts = keep

    def _ended(self, read: ReadPart) -> bool:
        """True once a given-up READ or push can write nothing more."""
        if read.push_id:
            return self.pushes.ended(read)
        try:
            return self.agent.poll(read.handle)
        except Exception:
            return True

    def __bool__(self) -> bool:
        return bool(self._parts)

    def peers(self) -> set[PeerId]:
        """The prefill ranks of the parts draining (never dropped meanwhile)."""
        return {read.peer_id for read, _ in self._parts}
