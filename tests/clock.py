"""A clock the tests move by hand, for the code that takes an injectable clock."""

from __future__ import annotations


class FakeClock:
    """A monotonic clock in seconds whose reading is :attr:`now`, set by the test.

    Args:
        now: the first reading (seconds).
    """

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
