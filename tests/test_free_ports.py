"""The test suite's port picker: ports handed out before any engine binds them must not be handed out again.

vLLM's API server binds with ``SO_REUSEPORT``: two engines given the same port both start and the kernel splits
the connections between them, so a test talking to one engine would sometimes get the other's answer.
"""

from __future__ import annotations

import socket
from typing import ClassVar

import pytest

import tests.conftest as conftest
from tests.conftest import free_ports


class _Scripted:
    """Stands in for ``random.Random``: ``randrange`` returns the given candidates in order."""

    candidates: ClassVar[list[int]] = []

    def randrange(self, *_args: int) -> int:
        return self.candidates.pop(0)


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the same base, nor one whose +100 (a decode side channel) or -100 lands on it: the next free one."""
    side = free_ports(1)[0]
    low, high = conftest.port_range()  # another test process may hold ports outside this one's range
    fresh = next(p for p in range(low, high, 8)
                 if all(abs(p + d - c) >= 8 for c in conftest._HANDED_OUT for d in (-100, 0, 100))
                 and _bindable(p, 2))
    _Scripted.candidates = [side, side + 96, side - 96, fresh]
    monkeypatch.setattr(conftest.random, "Random", _Scripted)
    assert free_ports(1) == [fresh]
    assert _Scripted.candidates == []



def _bindable(base: int, run: int) -> bool:
    try:
        for port in range(base, base + run):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True
