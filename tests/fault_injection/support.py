"""What the fault-injection tests share: a pull and its checks (exact bytes, released exactly once, never by
the lease where a "done" was due), the push helpers, and the spare prefill process a test may kill. The
fixtures are in ``conftest.py`` beside this module.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable

import pytest

from handshake import PROTOCOL_VERSION, Destination, MetadataReply, encode, fetch_agent_info
from handshake import decode as decode_message
from handshake.fingerprints import fingerprint
from tests.faults import FaultyNixlAgent, inject
from tests.handshake_support import fake_router
from tests.p2p_harness import ENGINE, DecodeSide, PrefillProc, pull_task
from tests.workers import COMPAT_FIELDS

HOST = "127.0.0.1"
BOUND_S = 10.0  # a failed or retried pull is reported within this (it takes well under a second)

_ids = itertools.count()
def new_ids() -> tuple[str, str]:
    n = next(_ids)
    return f"d-{n}", f"p-{n}"


def pull(d: DecodeSide, pf: PrefillProc, local: list[int], remote: list[int],
         engine_port: int | None = None, engine: str = "prefill-engine") -> tuple[str, str, set[int], float]:
    """Lease, pull and wait; ``(decode id, prefill id, load errors, seconds)``.

    Asserts the request finished receiving exactly once within :data:`BOUND_S`.
    """
    rid, prid = new_ids()
    pf.lease([prid])
    t0 = time.monotonic()
    d.start(pull_task(rid, prid, engine_port or pf.port, local, remote, engine=engine))
    missing = d.pump({rid}, BOUND_S)
    seconds = time.monotonic() - t0
    assert not missing, f"{rid} hung: not reported in finished_recving within {BOUND_S} s"
    d.pump(set(), 0.05)  # a few more steps: it must not be reported twice
    assert d.finished[rid] == 1, f"{rid} reported {d.finished[rid]} times"
    return rid, prid, d.take_errors(), seconds


def assert_bytes(d: DecodeSide, pf: PrefillProc, local: list[int], remote: list[int]) -> None:
    expected = pf.expected()
    bad = [lb for lb, rb in zip(local, remote, strict=True) if not d.block_ok(lb, rb, expected)]
    assert not bad, f"local blocks {bad} do not hold the prefill bytes"


def released(d: DecodeSide | None, pf: PrefillProc, ids: set[str], timeout_s: float = BOUND_S) -> bool:
    """True once every id in ``ids`` was released on the prefill side. The decode worker (if any) keeps
    stepping meanwhile, as an engine does: its steps progress NIXL's sends of the "done" notifications (one
    sent on a connection just set up, after a re-handshake, leaves only then)."""
    end = time.monotonic() + timeout_s
    while not ids <= pf.released() and time.monotonic() < end:
        if d is not None:
            d.step()
        pf.drain(0.005)
    return ids <= pf.released()


def clean_pull_succeeds(d: DecodeSide, pf: PrefillProc) -> None:
    local, remote = [40, 41, 42, 50], [60, 61, 62, 1]
    _, prid, errors, _ = pull(d, pf, local, remote)
    assert errors == set()
    assert_bytes(d, pf, local, remote)
    assert released(d, pf, {prid}) and pf.times_released(prid) == 1


PUSH_CFG = dict(transfer_mode="push", handshake_timeout_s=1.0, handshake_attempts=1, pull_thread=False)


def failure_lines(caplog: pytest.LogCaptureFixture, rid: str) -> list[str]:
    """The decode worker's "pull failed" log lines about ``rid``."""
    return [r.getMessage() for r in caplog.records
            if "pull failed" in r.getMessage() and f"request={rid} " in r.getMessage()]


def counting_handshakes(d: DecodeSide) -> FaultyNixlAgent:
    """Count the decode agent's ``add_remote_agent`` calls (one per handshake); nothing fails."""
    return inject(d.worker, "add_remote_agent", 10**9)


def settled(pf: PrefillProc, timeout_s: float = BOUND_S) -> dict:
    """The prefill worker's state once no WRITE is queued or in flight and no hold is pinned."""
    end = time.monotonic() + timeout_s
    while True:
        state = pf.state()
        if (state["pending"], state["pins"]) == (0, {}) or time.monotonic() > end:
            assert (state["pending"], state["pins"]) == (0, {}), f"WRITEs or pins left: {state}"
            return state["counters"]
        time.sleep(0.02)


def pushes_since(before: dict, after: dict) -> tuple[int, int, int]:
    """``(accepted, failed, written)`` push counts between two :func:`settled` states."""
    return tuple(after[k] - before[k] for k in ("accepted", "failed", "written"))  # type: ignore[return-value]


def released_once_not_expired(pf: PrefillProc, prid: str, d: DecodeSide | None = None,
                              timeout_s: float = BOUND_S) -> None:
    """The hold ended exactly once, by its "done" or a release (not by its lease); ``d`` steps meanwhile."""
    assert released(d, pf, {prid}, timeout_s), f"{prid} was not released within {timeout_s} s"
    pf.drain(0.05)
    assert pf.times_released(prid) == 1 and prid not in pf.expired, (pf.notified.get(prid), pf.expired.get(prid))


def wait_pinned(d: DecodeSide, pf: PrefillProc, prid: str, timeout_s: float = BOUND_S) -> float:
    """Step the decode worker until the prefill worker pinned ``prid`` for a WRITE; when it did."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        d.step()
        pf.drain(0.005)
        pinned = [t for rid, answer, t in pf.pins if rid == prid and answer == "held"]
        if pinned:
            return pinned[0]
    raise AssertionError(f"the prefill worker never accepted a push of {prid}")


def fake_side_channel(respond: Callable[[list[bytes]], list[bytes] | None] | None,
                      delay_s: float | Callable[[list[bytes]], float] = 0.0
                      ) -> contextlib.AbstractContextManager[tuple[int, list[list[bytes]]]]:
    """A fake side channel on 127.0.0.1 (:func:`tests.handshake_support.fake_router`): answers each request with
    ``respond(body)`` after ``delay_s`` (``respond=None``: never answers). Yields ``(port, requests seen)``."""
    return fake_router(respond, delay_s=delay_s)


def real_reply(pf: PrefillProc, nonce: bytes | None = None) -> Callable[[list[bytes]], list[bytes]]:
    """Answers with the prefill process's own (valid) metadata, echoing each request's nonce
    (or always ``nonce``: a reply captured from another exchange)."""
    info = fetch_agent_info(Destination(HOST, pf.port, ENGINE, 0), "test", fingerprint(COMPAT_FIELDS), timeout_s=5.0,
                            retries=2)

    def respond(body: list[bytes]) -> list[bytes]:
        echoed = decode_message(body, None).nonce if nonce is None else nonce
        return encode(MetadataReply(protocol_version=PROTOCOL_VERSION, info=info, nonce=echoed), None)

    return respond
