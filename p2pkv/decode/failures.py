"""Why a pull failed: a closed set of kinds, the same in the log line and in ``p2pkv:pull_failures_total{kind}``."""

from __future__ import annotations

import enum


class FailureKind(str, enum.Enum):
    """What went wrong with a pull (the value is the metric label and the ``kind=`` of the log line)."""

    HANDSHAKE = "handshake"
    """The prefill rank's side channel did not answer, or answered with an error."""
    REFUSED = "refused"
    """The two engines cannot pair (compatibility fields, model shape, TP mapping, layout): names both sides' values."""
    BAD_BLOCK_IDS = "bad_block_ids"
    """Block ids out of range or not pairing up."""
    STAGING = "staging"
    """The pull needs more staging memory than ``staging_mib`` holds."""
    FIXUP = "fixup"
    """The post-receive fixup of a staged READ failed."""
    DISCONNECT = "disconnect"
    """NIXL reported the peer gone during a READ."""
    TRANSFER = "transfer"
    """Any other NIXL failure posting or running a READ."""
    TIMEOUT = "timeout"
    """A pull past its state's deadline (:mod:`p2pkv.decode.deadlines`): a handshake never done, staging never
    free, a READ still in flight or a fence never answered after ``transfer_timeout_s``."""
    LEASE_EXPIRED = "lease_expired"
    """The prefill lease ended before the READ finished: the blocks may have been reused."""
    NOT_HELD = "not_held"
    """The prefill engine does not hold these blocks for this request (released after an earlier pull,
    never held, or other block ids)."""
    UNCONFIRMED = "unconfirmed"
    """The prefill rank could not confirm that it still held the blocks."""
    DIGEST_MISMATCH = "digest_mismatch"
    """Verified KV (``verify_kv``): what landed differs from the prefill rank's digest of what it sent, or the
    prefill rank gave no digest (fail closed)."""

    def __str__(self) -> str:
        return self.value
