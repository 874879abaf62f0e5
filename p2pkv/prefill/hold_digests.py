"""Verified KV, pull: a prefill rank's digest of the rows a decode rank READs from one of its holds.

A decode rank that verifies what it READs (``verify_kv``) sends, with the
fence question it asks when it posts a READ (:class:`handshake.HoldQuery`,
``digest_rows``), the rows it READs on this rank's side. For each held
request (:meth:`HoldDigests.on_digest`, on the side-channel thread) the rows
are checked, in this order: the KV cache is in host memory, the request is
held with exactly those block ids (pinned while its rows are digested, so no
release or lease expiry ends the hold meanwhile), the rows are whole rows,
and every byte lies in the held blocks
(:func:`p2pkv.dataplane.plan.check_rows_in_blocks`: whoever reaches the side
channel chooses the rows, and only a held request's blocks may be read).
Then the digest of those bytes is the answer
(:func:`p2pkv.dataplane.digest.digest_rows`); any failed check answers
``b""``, which the decode rank treats as a failed load (fail closed).
"""

from __future__ import annotations

import logging

from p2pkv.dataplane.digest import DigestError, check_host, digest_rows
from p2pkv.dataplane.layout import KVLayout
from p2pkv.dataplane.plan import PlanError, check_block_ids, check_rows_in_blocks
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.push_requests import rows_of

__all__ = ["HoldDigests"]

logger = logging.getLogger("p2pkv.prefill")


class HoldDigests:
    """Digests of held blocks' rows for the decode ranks that READ them (the side channel's ``on_digest``).

    Args:
        holds: this rank's holds.
        layout: this rank's KV layout (its segments and ``num_blocks``: where held blocks lie).
        device: the KV cache's torch device type (only host memory is digested).
    """

    def __init__(self, holds: PrefillHolds, layout: KVLayout, device: str) -> None:
        self.holds = holds
        self.layout = layout
        self.device = device
        self.answered = 0
        self.refused = 0

    def on_digest(self, request_id: str, block_ids: list[int], rows: bytes) -> bytes:
        """The digest of ``rows`` (:data:`handshake.messages.Rows`) of held request ``request_id`` with
        ``block_ids``, or ``b""`` when a check fails (see the module docstring; logged). Never raises."""
        why = self._refusal(block_ids, rows)
        if why:
            self.refused += 1
            logger.warning("p2pkv: digest of request %s refused: %s", request_id[:64], why)
            return b""
        if self.holds.pin(request_id, block_ids) != "held":
            return b""  # ended since the fence's answer: the fence says so
        try:
            digest = digest_rows(rows_of(rows))  # type: ignore[arg-type]  # checked by _refusal
        finally:
            self.holds.unpin(request_id)
        self.answered += 1
        return digest

    def _refusal(self, block_ids: list[int], rows: bytes) -> str:
        """Why ``rows`` cannot be digested here (``""``: they can)."""
        try:
            check_host(self.device)
        except DigestError as exc:
            return str(exc)
        parsed = rows_of(rows)
        if parsed is None:
            return "digest_rows are not whole 24-byte rows"
        try:
            check_block_ids(block_ids, self.layout.num_blocks, "held")
            check_rows_in_blocks(parsed, self.layout.segments, self.layout.num_blocks, block_ids)
        except PlanError as exc:
            return f"digest_rows: {exc}"
        return ""
