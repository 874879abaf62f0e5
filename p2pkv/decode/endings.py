"""How a decode rank's transfers change state and end: handed to vLLM, failed, or given up.

:class:`Endings` is the one place a transfer's state is set
(:meth:`Endings.to`); :class:`p2pkv.decode.receiver.Receiver` decides when.
A transfer that ends leaves the receiver's lists and, unless parts of it
still drain (:mod:`p2pkv.decode.drain`), is handed to vLLM at once
(:class:`p2pkv.decode.outcomes.Outcomes`). A failed one (:meth:`Endings.fail`)
is logged and counted, its blocks become load errors, and the prefill ranks
it answers for are told to free the request (a release; for a layer stream,
of the stream id, which stops the stream). A layer stream whose request
ended while it ran is given up (:meth:`Endings.give_up`): the same release,
but reported finished with no load errors.
"""

from __future__ import annotations

import logging
import time

from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.rank import LocalRank
from p2pkv.decode.background import Background
from p2pkv.decode.drain import Drain
from p2pkv.decode.failures import FailureKind
from p2pkv.decode.keeper import PeerKeeper
from p2pkv.decode.outcomes import Outcomes
from p2pkv.decode.peers import PeerTable
from p2pkv.decode.pull_spans import TransferSpans
from p2pkv.decode.release import release_failed
from p2pkv.decode.transfer import Transfer, TransferState
from p2pkv.metadata import LoadSpec
from p2pkv.telemetry.stats import StatsBuffer

logger = logging.getLogger("p2pkv.decode")


class Endings:
    """State changes and endings of one decode rank's transfers (the receiver's lock held by every caller).

    Args:
        rank: this rank (its name is the requester of releases).
        config: p2pkv settings (the side channel's timeout).
        secret: the side-channel key (None: insecure).
        transfers: the receiver's transfers under way (an ended one is removed).
        staging_wait: those of them waiting for staging (an ended one is removed).
        outcomes: where an ended transfer goes for vLLM's next step.
        peers: the rank's prefill peers (touched when a transfer ends: idle from then on).
        keeper: the handshakes (those nobody waits for any more are cancelled).
        drain: given-up parts that may still write (a transfer is handed to vLLM once they ended).
        background: where releases are sent.
        stats: failures counted.
        spans: the transfers' trace spans (None: tracing off).
    """

    def __init__(self, rank: LocalRank, config: P2pKvConfig, secret: bytes | None, transfers: list[Transfer],
                 staging_wait: list[Transfer], outcomes: Outcomes, peers: PeerTable, keeper: PeerKeeper,
                 drain: Drain, background: Background, stats: StatsBuffer, spans: TransferSpans | None) -> None:
        self.rank = rank
        self.config = config
        self._secret = secret
        self.transfers = transfers
        self.staging_wait = staging_wait
        self.outcomes = outcomes
        self.peers = peers
        self.keeper = keeper
        self.drain = drain
        self.background = background
        self.stats = stats
        self.spans = spans

    def to(self, transfer: Transfer, state: TransferState) -> None:
        """Move ``transfer`` to ``state`` (its deadline counts from now); one that has ended leaves the lists and
        is handed to vLLM unless parts of it still drain."""
        if state is not transfer.state:
            transfer.state, transfer.since = state, time.monotonic()
        if transfer.finished:
            self.peers.touch(transfer.peers)  # idle from now on
            if transfer in self.transfers:
                self.transfers.remove(transfer)
            if transfer in self.staging_wait:
                self.staging_wait.remove(transfer)
            if not transfer.draining:
                self.outcomes.report(transfer)

    def fail(self, transfer: Transfer, kind: FailureKind, why: str) -> None:
        """Report a transfer as failed: its local blocks become load errors, the request finishes. Once each."""
        if transfer.finished:
            return
        spec, handshaking = transfer.spec, transfer.state is TransferState.HANDSHAKE
        if _log_failure(spec, kind, why):
            self.stats.record_failure(kind.value)
        self.to(transfer, TransferState.FAILED)
        if self.spans is not None:
            try:
                self.spans.ended(transfer, (kind, why))
            except Exception:
                logger.exception("p2pkv: tracing a pull failed")
        self._ended_early(transfer, handshaking)

    def give_up(self, transfer: Transfer) -> None:
        """A layer stream whose request ended (aborted) while it ran: the prefill ranks are told to stop it (they
        stop WRITing and say so once no WRITE is in flight), and vLLM gets the blocks back once that word came or
        the stream's window passed (the prefill rank WRITEs nothing after it); reported finished, with no load
        errors (nobody reads them)."""
        if transfer.finished:
            return
        logger.info("p2pkv: request %s ended while its KV was streamed; the stream is given up",
                    transfer.request_id)
        handshaking = transfer.state is TransferState.HANDSHAKE
        self.drain.abandon(transfer)
        transfer.given_up = True
        self.to(transfer, TransferState.FAILED)
        self._ended_early(transfer, handshaking)

    def _ended_early(self, transfer: Transfer, handshaking: bool) -> None:
        """Handshakes nobody waits for any more are not started (a running one ends by itself), and the prefill
        ranks it answers for are told to free the request."""
        if handshaking:
            self.keeper.cancel_unneeded()
        spec = transfer.spec
        release_failed(self.background, spec.remote, self.rank.answered_ranks(spec.remote.tp_size, spec.remote.pp_size),
                       self.rank.name, self._secret, self.config.handshake_timeout_s)


def _log_failure(spec: LoadSpec, kind: FailureKind, why: str) -> bool:
    """Log a failed pull; False (a warning only, not a pull failure) for a request that ended before its pull."""
    if spec.report or spec.local_block_ids:
        logger.error("p2pkv: pull failed kind=%s request=%s remote_request=%s peer=%s:%d blocks=%d reason=%s",
                     kind.value, spec.request_id, spec.remote.request_id, spec.remote.host, spec.remote.port,
                     len(spec.local_block_ids), why)
        return True
    logger.warning("p2pkv: request %s ended before its pull; could not tell %s:%d to free %s now (its lease frees "
                   "it): %s", spec.request_id, spec.remote.host, spec.remote.port, spec.remote.request_id, why)
    return False
