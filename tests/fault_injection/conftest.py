"""The fault-injection tests: a real prefill :class:`~p2pkv.worker.WorkerSide` in its own process
(:class:`tests.p2p_harness.PrefillProc`, one per module: ``prefill``) and a real decode ``WorkerSide`` in the
test's (``decode``; per transfer mode: ``mode_decode``; push: ``push_decode``), stepped only by the test
(``prefill``, ``decode`` and ``mode_decode`` are ``tests/conftest.py``'s; here: ``victim``, ``push_decode``).

The documented behaviour is ``p2pkv/worker.py``'s and ``docs/reliability.md``'s; one module per fault family:
``test_nixl.py`` (a NIXL call of a READ, or of a push's WRITE, fails), ``test_side_channel.py`` (the side
channel and the notifications), ``test_push.py`` (a push's WRITE stalls, comes late or never, its prefill
process dies or restarts), ``test_lifecycle.py`` (leases, shutdown).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.p2p_harness import DECODE_CFG, DecodeSide, PrefillProc, free_port


@pytest.fixture
def victim() -> Iterator[PrefillProc]:
    """A prefill process of its own for a test that kills it (stopped at the end if it still lives)."""
    pf = PrefillProc(free_port(), seed=2, num_blocks=64, lease_s=30.0)
    pf.start()
    try:
        yield pf
    finally:
        if pf.alive():
            pf.stop()


@pytest.fixture
def push_decode() -> Iterator[DecodeSide]:
    """A decode worker in push mode (the prefill rank WRITEs), stepped only by the test."""
    d = DecodeSide(64, transfer_mode="push", **DECODE_CFG)
    try:
        yield d
    finally:
        d.close()

