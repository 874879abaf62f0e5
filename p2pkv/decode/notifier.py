"""The "done" notifications of a decode rank's finished pulls, sent at the next engine step.

A pull that is confirmed (or has nothing to load) is queued here; the engine
thread, which keeps progressing NIXL's sends, tells every prefill rank the
decode rank answers for that it may free the request's blocks
(:mod:`p2pkv.notification`), then the pull's trace spans are emitted.

An engine with nothing to run takes no step: a notify-only pull (its request
aborted before its blocks were allocated, say a client that left) whose
handshake ended after the engine's last step would wait for the next
request, or leave the prefill's hold to its lease. So when the engine has not
stepped for :data:`IDLE_S`, the pulls' thread sends what is queued itself and
progresses NIXL for :data:`FLUSH_S` after, so that the notification goes out
(:meth:`Notifier.send_if_idle`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.decode.peers import PeerId, PeerTable
from p2pkv.decode.pull_spans import TransferSpans
from p2pkv.decode.transfer import Transfer
from p2pkv.notification import DoneNotification, blocks_digest, encode_done

logger = logging.getLogger("p2pkv.decode")

IDLE_S = 0.05
"""How long (seconds) without an engine step before the pulls' thread sends queued notifications itself: far
longer than a busy engine's step, so it does so only when the engine is idle."""
FLUSH_S = 2.0
"""How long (seconds) the pulls' thread keeps progressing NIXL after sending them (NIXL's UCX backend sends a
notification as its worker progresses)."""

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
        self._stepped = time.monotonic()  # the engine's last step
        self._flush_until = float("-inf")

    def add(self, transfer: Transfer) -> None:
        """Notify ``pull``'s prefill ranks at the next :meth:`send`."""
        self.pending.append(transfer)

    def needed_peers(self) -> set[PeerId]:
        """Prefill ranks a queued notification still goes to (never dropped meanwhile)."""
        return {pid for transfer in self.pending for pid, _ in transfer.notify}

    def send(self, contained: Contained) -> None:
        """Send every queued notification (the queue is emptied first: one that raises is not sent again); the
        engine thread's, at each step."""
        self._stepped = time.monotonic()
        self._send(contained)

    def send_if_idle(self, contained: Contained) -> bool:
        """The pulls' thread: send what is queued when the engine has not stepped for :data:`IDLE_S`, then
        progress NIXL; True while something is queued or it keeps progressing (:data:`FLUSH_S` after the last
        send): the thread turns again soon."""
        now = time.monotonic()
        if self.pending and now - self._stepped > IDLE_S:
            self._send(contained)
            self._flush_until = now + FLUSH_S
        if now < self._flush_until:
            self.agent.progress()
            return True
        return bool(self.pending)

    def _send(self, contained: Contained) -> None:
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



