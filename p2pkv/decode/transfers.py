"""How a pull's parts move: each READ by this rank, or asked of its prefill rank as a push; then polled.

The parts and their rows come from :func:`p2pkv.decode.reads.plan_reads`;
who moves each is :class:`p2pkv.decode.direction.Directions`'s; what the
pull does about each outcome (retry, fail, confirm) is
:class:`p2pkv.decode.puller.Puller`'s. A READ gets its fence question when
posted and again when done (:mod:`p2pkv.decode.fence`); a pushed part needs
none: the prefill rank keeps the hold until its WRITE has ended, so the
part is confirmed when its notification lands.
"""

from __future__ import annotations

from p2pkv.dataplane.agent import NixlTransferAgent
from p2pkv.dataplane.stager import Stager
from p2pkv.decode.direction import Direction, Directions
from p2pkv.decode.fence import Fence, Phase
from p2pkv.decode.pull import Pull, ReadPart
from p2pkv.decode.pushes import Pushes
from p2pkv.decode.reads import ReadEvent, poll_read


class Transfers:
    """Starts and polls the parts of one decode rank's pulls.

    Args:
        agent: the rank's NIXL agent (READs are posted and polled there).
        stager: the staging area (a staged part is fixed up when it lands).
        fence: where a READ's fence questions go.
        pushes: where a pushed part's request goes and its notification comes from.
        directions: each prefill agent's direction.
    """

    def __init__(self, agent: NixlTransferAgent, stager: Stager, fence: Fence, pushes: Pushes,
                 directions: Directions) -> None:
        self.agent = agent
        self.stager = stager
        self.fence = fence
        self.pushes = pushes
        self.directions = directions

    def start(self, pull: Pull) -> tuple[ReadPart, Exception] | None:
        """Post every part of ``pull``: a READ (and its first fence question), or its push request.

        Returns:
            The first part that could not start and why (the parts after it
            are not started), or None.
        """
        for read in pull.reads:
            try:
                if self.directions.of(pull.spec.remote.transfer_mode, read.peer.agent_name) is Direction.PUSH:
                    self.pushes.post(read)
                    continue
                read.handle = self.agent.start_read(read.peer.agent_name, read.local_descs, read.remote_descs)
            except Exception as exc:
                return read, exc
            self.fence.add(read, Phase.BEFORE)
        return None

    def poll(self, read: ReadPart, now: float) -> tuple[ReadEvent, Exception | None]:
        """Poll one part at ``now`` (``time.monotonic()``, :func:`p2pkv.decode.reads.poll_read`); a READ seen
        done gets its fence question after the READ, a pushed one is confirmed at once."""
        event, exc = poll_read(self.agent, self.stager, read, now)
        if event is ReadEvent.DONE and read.push_id:
            read.confirmed = True  # the prefill rank kept the hold until its WRITE ended
        elif event is ReadEvent.DONE:
            self.fence.add(read, Phase.AFTER)
        return event, exc
