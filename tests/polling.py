"""Waiting in tests for something another thread or process does: poll a condition until it holds or time is up."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(check: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.01) -> bool:
    """True once ``check()`` is true, polled every ``interval_s`` for ``timeout_s`` seconds (and once more at the
    end); False if it never was."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(interval_s)
    return bool(check())


def wait_until(check: Callable[[], object], timeout_s: float = 20.0, message: str = "never happened",
               interval_s: float = 0.002) -> None:
    """Return once ``check()`` is true (:func:`eventually`); fail the test with ``message`` if it never is."""
    assert eventually(check, timeout_s, interval_s), message
