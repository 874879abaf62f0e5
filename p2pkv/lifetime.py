"""How long a signed value (a capability, a stream grant) lives, on the clock of the engine that receives it.

A value's expiry is the signer's; the receiver accepts it :data:`CLOCK_SKEW_S` past that (clocks differ), and
never more than ``max_lifetime_s`` (:attr:`p2pkv.config.P2pKvConfig.max_lifetime_s`) ahead of its own clock
(:func:`lifetime_refusal`): whatever it remembers of one (bound stream ids, bound capabilities, served streams)
lasts at most that long, even when a signer's clock runs a day fast.
"""

from __future__ import annotations

from p2pkv.config import DEFAULT_LEASE_S, LIFETIME_LEASES

CLOCK_SKEW_S = 5.0
"""How long (seconds) after its expiry a capability is still accepted: the clocks of the two engines may differ."""

DEFAULT_MAX_LIFETIME_S = LIFETIME_LEASES * DEFAULT_LEASE_S
"""How far (seconds) past the receiver's clock a capability's or stream grant's expiry may lie when the caller
does not say (:attr:`p2pkv.config.P2pKvConfig.max_lifetime_s` with the default ``lease_s``: 480 s); engines pass
their own ``max_lifetime_s``."""


def lifetime_refusal(key: str, expiry: float, now: float, max_lifetime_s: float, fix: str) -> str | None:
    """Why an expiry (seconds since the Unix epoch) more than ``max_lifetime_s`` + :data:`CLOCK_SKEW_S` seconds
    after ``now`` (this engine's clock) is refused, naming ``key``, how far ahead it is, the limit and ``fix``; None
    when it is not that far."""
    ahead = expiry - now
    if ahead <= max_lifetime_s + CLOCK_SKEW_S:
        return None
    return (f"{key} expires {ahead:.0f} s from now, more than the {max_lifetime_s:.0f} s this engine accepts "
            f"(max_lifetime_s: {LIFETIME_LEASES} x the larger of its lease_s and {DEFAULT_LEASE_S:.0f} s, plus "
            f"{CLOCK_SKEW_S:.0f} s of clock skew): {fix}")


__all__ = ["CLOCK_SKEW_S", "DEFAULT_MAX_LIFETIME_S", "lifetime_refusal"]
