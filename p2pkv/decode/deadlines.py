"""How long a pull may stay in each state before it fails with ``FailureKind.TIMEOUT``.

Every state a pull waits in has a deadline, counted from when it entered
that state (:attr:`p2pkv.decode.transfer.Transfer.since`), so no pull waits forever
on a handshake that never ends, staging that never frees, a READ that never
completes or a fence answer that never comes; its local blocks are then
reported as load errors like every failure. The receiver checks them at each
advance.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.config import P2pKvConfig
from p2pkv.decode.peers import handshake_budget_s
from p2pkv.decode.transfer import Transfer, TransferState
from p2pkv.ways import Window

HANDSHAKE_MARGIN_S = 2.0
"""Slack (seconds) past the longest handshake: a queued handshake waits for a free thread first."""


@dataclass(frozen=True)
class Deadlines:
    """Seconds a pull may stay in each waiting state.

    Attributes:
        handshake_s: ``HANDSHAKE``: every attempt of a handshake, the pauses
            between them, and :data:`HANDSHAKE_MARGIN_S`.
        staging_s: ``STAGING``: waiting for room (``transfer_timeout_s``).
        reading_s: ``READING``: READs in flight (``transfer_timeout_s``).
        streaming_s: ``READING`` of a layer stream: waiting for its prefill's
            final notification, the prefill's queue and forward included
            (``stream_timeout_s``, :attr:`p2pkv.config.P2pKvConfig.stream_window_s`).
        fencing_s: ``FENCING``: waiting for the prefill ranks' confirmations
            (``transfer_timeout_s``; the fence gives up sooner by itself).
    """

    handshake_s: float
    staging_s: float
    reading_s: float
    fencing_s: float
    streaming_s: float

    @classmethod
    def of(cls, config: P2pKvConfig) -> Deadlines:
        """The deadlines ``config``'s timeouts give."""
        hs = handshake_budget_s(config.handshake_timeout_s) + HANDSHAKE_MARGIN_S
        t = config.transfer_timeout_s
        return cls(handshake_s=hs, staging_s=t, reading_s=t, fencing_s=t, streaming_s=config.stream_window_s)

    def limit(self, state: TransferState, window: Window = "transfer_timeout_s") -> float | None:
        """Seconds a pull may stay in ``state`` (None: no limit, ``DONE`` and ``FAILED``); ``window``: the setting
        that bounds its way's wait for its bytes (:attr:`p2pkv.ways.Way.window`: a layer stream's ``READING``
        lasts the prefill)."""
        if state is TransferState.READING:
            return self.streaming_s if window == "stream_timeout_s" else self.reading_s
        if state is TransferState.FENCING:
            return self.fencing_s
        if state is TransferState.HANDSHAKE:
            return self.handshake_s
        return self.staging_s if state is TransferState.STAGING else None

    def overdue(self, transfer: Transfer, now: float) -> str | None:
        """Why ``pull`` is past its state's deadline at ``now`` (``time.monotonic()`` seconds), or None."""
        window = transfer.way.window
        limit = self.limit(transfer.state, window)
        if limit is None or now - transfer.since <= limit:
            return None
        what = {TransferState.HANDSHAKE: "waiting for the handshake with its prefill ranks",
                TransferState.STAGING: "waiting for room in staging (staging_mib)",
                TransferState.READING: _WAITING[window],
                TransferState.FENCING: "waiting for the prefill ranks to confirm their holds"}[transfer.state]
        return f"timed out {what} after {limit:g} s (state {transfer.state.value})"


_WAITING: dict[Window, str] = {"transfer_timeout_s": "READ still in flight",
                               "stream_timeout_s": "waiting for the prefill's stream (stream_timeout_s)"}
"""What a pull past its ``READING`` deadline was waiting for, by the window its way's wait has."""
