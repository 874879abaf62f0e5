"""The "done" notifications of a decode rank's finished pulls, sent at the next engine step.

A pull that is confirmed (or has nothing to load) is queued here; the engine
thread, which keeps progressing NIXL's sends, tells every prefill rank the
decode rank answers for that it may free the request's blocks
(:mod:`p2pkv.notification`), then the pull's trace spans are emitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.decode.peers import PeerId, PeerTable
from p2pkv.decode.spans import TransferSpans
from p2pkv.decode.transfer import Transfer
from p2pkv.notification import DoneNotification, blocks_digest, encode_done

logger = logging.getLogger("p2pkv.decode")

Contained = Callable[..., None]
"""``contained(pull | None, what, fn, *args)``: run ``fn(*args)``, an exception failing ``pull`` only (logged)."""


class Notifier:
    """Queued "done" notifications of one decode rank.

    Args:
        agent: the rank's NIXL agent (sends the notifications).
        peers: the prefill ranks it knows.
        reader: ``<engine_id>:<tp_rank>`` of this decode rank.
        secret: the side-channel secret the notifications are signed with (None: insecure).
        spans: the pulls' trace spans (None: tracing off).
    """

    def __init__(self, agent: NixlTransferAgent, peers: PeerTable, reader: str, secret: bytes | None,
                 spans: TransferSpans | None) -> None:
        self.agent, self.peers, self.reader, self.secret, self.spans = agent, peers, reader, secret, spans
        self.pending: list[Transfer] = []

    def add(self, transfer: Transfer) -> None:
        """Notify ``pull``'s prefill ranks at the next :meth:`send`."""
        self.pending.append(transfer)

    def needed_peers(self) -> set[PeerId]:
        """Prefill ranks a queued notification still goes to (never dropped meanwhile)."""
        return {pid for transfer in self.pending for pid, _ in transfer.notify}

    def send(self, contained: Contained) -> None:
        """Send every queued notification (the queue is emptied first: one that raises is not sent again)."""
        transfers, self.pending = self.pending, []
        for transfer in transfers:
            contained(transfer, "notifying the prefill ranks", self.notify, transfer)
            if self.spans is not None:
                contained(None, "tracing a pull", self.spans.ended, transfer)

    def notify(self, transfer: Transfer) -> None:
        """Tell every prefill rank this decode rank answers for that it may free ``pull``'s blocks.

        Sent after the READs are done and fenced, not attached to them: a READ
        with a notification completes only once the prefill side progresses
        NIXL. One that cannot be sent is logged; the prefill lease frees the
        blocks instead.
        """
        rid, digest = transfer.spec.remote.request_id, blocks_digest(transfer.spec.remote.block_ids)
        for pid, notifiers in transfer.notify:
            peer = self.peers.peers.get(pid)
            if peer is None:
                logger.warning("p2pkv: cannot notify %s about %s (peer gone); its lease frees the blocks", pid, rid)
                continue
            note = DoneNotification(rid, self.reader, notifiers, digest)
            try:
                self.agent.send_notif(peer.agent_name, encode_done(note, self.secret))
            except TransferError as exc:
                logger.warning("p2pkv: %s; the prefill engine frees the blocks when the lease ends", exc)
        transfer.marks["notified"] = time.time()



