"""How a pull's parts move: each started by the mover of the direction chosen for its prefill rank, then polled.

The parts and their rows come from :func:`p2pkv.decode.reads.plan_reads`;
which way each moves is :class:`p2pkv.decode.direction.Directions`'s, how is
its :class:`p2pkv.decode.movers.Mover`'s (a READ gets its fence question when
posted and again when done; a pushed part is confirmed when its notification
lands); what the pull does about each outcome (retry, fail, confirm) is
:class:`p2pkv.decode.receiver.Receiver`'s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from p2pkv.decode.direction import Direction, Directions
from p2pkv.decode.movers import Mover
from p2pkv.decode.reads import ReadEvent
from p2pkv.decode.transfer import Part, Transfer

if TYPE_CHECKING:
    from p2pkv.dataplane.rank import LocalRank
    from p2pkv.dataplane.topology import RankRead
    from p2pkv.decode.peers import Peer, PeerId

logger = logging.getLogger("p2pkv.decode")


class Transfers:
    """Starts and polls the parts of one decode rank's pulls.

    Args:
        movers: the mover of each direction (:func:`p2pkv.decode.movers.movers`).
        directions: each prefill agent's direction.
    """

    def __init__(self, movers: dict[Direction, Mover], directions: Directions) -> None:
        self.movers = movers
        self.directions = directions

    def plan(self, transfer: Transfer, reads: list[RankRead], notify: list[int], rank: LocalRank,
             peers: dict[PeerId, Peer]) -> tuple[bool, list[int]]:
        """Plan ``transfer``'s parts (:meth:`p2pkv.decode.movers.Mover.plan`) with the mover of the way its load
        fixes, or, when each part's way is chosen as it starts, as rows (pull's: a push moves the same rows)."""
        return self.movers[transfer.fixed or Direction.PULL].plan(transfer, reads, notify, rank, peers)

    def start(self, transfer: Transfer) -> tuple[Part, Exception] | None:
        """Post every part of ``pull`` with its direction's mover: cut first into the parts that mover moves
        (a push request's rows are bounded: a longer part goes in several), or with that mover's fallback's
        when it cannot carry the part (a staged part too long for one push request is READ; logged).

        Returns:
            The first part that could not start and why (the parts after it
            are not started), or None.
        """
        i = 0
        while i < len(transfer.parts):
            read = transfer.parts[i]
            mover = self.movers[self.directions.of(transfer.spec.remote.transfer_mode, read.peer.agent_name)]
            pieces = mover.split(read)
            transfer.parts[i:i + 1] = pieces
            i += len(pieces)
            for piece in pieces:
                if (failed := self._post(transfer, mover, piece)) is not None:
                    return failed
        return None

    def _post(self, transfer: Transfer, mover: Mover, read: Part) -> tuple[Part, Exception] | None:
        """Post one part with ``mover``, or its fallback when it cannot carry it; the part and why, if it failed."""
        if (why := mover.cannot_carry(read)) is not None and mover.fallback is not None:
            logger.warning("p2pkv: request %s moves its part from %s by %s, not %s: %s", transfer.request_id,
                           read.peer.agent_name, mover.fallback.value, mover.direction.value, why)
            mover = self.movers[mover.fallback]
        try:
            mover.post(read)
        except Exception as exc:
            return read, exc
        read.direction, read.live = mover.direction, True
        return None

    def poll(self, read: Part, now: float) -> tuple[ReadEvent, Exception | None]:
        """Poll one part in flight at ``now`` (``time.monotonic()``); one seen done gets what confirms it
        (:meth:`p2pkv.decode.movers.Mover.landed`)."""
        mover = self.mover_of(read)
        event, exc = mover.poll(read, now)
        if event is ReadEvent.DONE:
            mover.landed(read)
        return event, exc

    def mover_of(self, read: Part) -> Mover:
        """The mover of a posted part.

        Raises:
            KeyError: ``read`` was never posted.
        """
        if read.direction is None:
            raise KeyError("a part that was never posted has no mover")
        return self.movers[read.direction]
