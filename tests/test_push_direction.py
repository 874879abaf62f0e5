"""Push mode, decode side, pure pieces: which way a peer's bytes move (``decode.direction.choose``) and what a push
request's answer means for its pull (``decode.pushes.failure_of_push``)."""

from __future__ import annotations

import pytest

from handshake import (
    PROTOCOL_VERSION,
    HandshakeCancelledError,
    HandshakeTimeoutError,
    MalformedMessageError,
    PushReply,
    RemoteRefusedError,
)
from p2pkv.dataplane.transport import TransportReport
from p2pkv.decode.direction import Choice, Direction, Directions, choose
from p2pkv.decode.failures import FailureKind
from p2pkv.decode.pushes import failure_of_push
from p2pkv.ways import STREAM


def report(transport: str, mem_type: str = "DRAM", protocol: str = "", op: str = "READ") -> TransportReport:
    """What UCX said of one peer's xfers."""
    return TransportReport("prefill-agent", mem_type, transport, "intra-node", "", op, protocol)  # type: ignore[arg-type]


# ---- direction --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["pull", "push"])
@pytest.mark.parametrize("seen", [None, report("cma"), report("tcp", "VRAM"), report("unknown")],
                         ids=["no_report", "cma", "vram_tcp", "unknown"])
def test_a_fixed_setting_ignores_what_ucx_said(setting: str, seen: TransportReport | None) -> None:
    choice = choose(setting, seen)  # type: ignore[arg-type]
    assert choice == Choice(Direction(setting), f"transfer_mode={setting}")


@pytest.mark.parametrize(("seen", "direction", "named"), [
    (None, Direction.PULL, "no READ from this peer yet"),
    (report("unknown"), Direction.PULL, "no transport"),
    (report("cma"), Direction.PULL, "cma (zero-copy)"),
    (report("cma", protocol="zero-copy"), Direction.PULL, "cma (zero-copy)"),
    (report("cuda_ipc", "VRAM", "zero-copy"), Direction.PULL, "cuda_ipc (zero-copy)"),
    (report("rc_mlx5", "VRAM", "zero-copy"), Direction.PULL, "rc_mlx5 (zero-copy)"),
    (report("tcp", "VRAM"), Direction.PUSH, "VRAM move by tcp, not zero-copy"),
    (report("cuda_copy+tcp", "VRAM", "copy-in"), Direction.PUSH, "cuda_copy+tcp, not zero-copy"),
    (report("tcp"), Direction.PUSH, "DRAM move by tcp"),
    (report("cuda_ipc", "VRAM", "copy-in"), Direction.PUSH, "not zero-copy"),
], ids=["no_report", "unknown", "cma", "cma_zcopy", "cuda_ipc", "rdma", "vram_tcp", "vram_staged", "dram_tcp",
        "cuda_ipc_copy_in"])
def test_auto_pulls_until_ucx_says_reads_are_not_zero_copy(seen: TransportReport | None, direction: Direction,
                                                          named: str) -> None:
    choice = choose("auto", seen)
    assert choice.direction is direction
    assert choice.reason.startswith("auto: ") and named in choice.reason, choice.reason


def test_a_peers_direction_follows_its_read_reports_under_auto_only(caplog: pytest.LogCaptureFixture) -> None:
    """``Directions``: a request naming a mode gets it; else each peer's choice, which under ``auto`` only a READ
    report changes (a WRITE report, this rank pushing as a prefill rank, says nothing about READs); logged once
    per new choice."""
    import logging

    caplog.set_level(logging.INFO, logger="p2pkv.decode")
    auto = Directions("auto")
    assert auto.of("", "prefill-agent") is Direction.PULL
    assert auto.of("push", "prefill-agent") is Direction.PUSH and auto.of("pull", "other") is Direction.PULL
    auto.on_transport(report("tcp", "VRAM", op="WRITE"))
    assert auto.of("", "prefill-agent") is Direction.PULL, "a WRITE report decided a READ direction"
    auto.on_transport(report("tcp", "VRAM"))
    assert auto.of("", "prefill-agent") is Direction.PUSH and auto.of("pull", "prefill-agent") is Direction.PULL
    assert auto.of("", "other") is Direction.PULL, "another peer's report decided this one"
    auto.on_transport(report("tcp", "VRAM"))  # the same again: not logged again
    auto.on_transport(report("cuda_ipc", "VRAM", "zero-copy"))
    assert auto.of("", "prefill-agent") is Direction.PULL
    lines = [r.getMessage() for r in caplog.records if "prefill-agent" in r.getMessage()]
    assert [line.split(" from ")[0] for line in lines] == ["p2pkv: pull", "p2pkv: push", "p2pkv: pull"], lines
    for setting in ("pull", "push"):
        fixed = Directions(setting)  # type: ignore[arg-type]
        fixed.on_transport(report("tcp", "VRAM"))
        fixed.on_transport(report("cma"))
        assert fixed.of("", "prefill-agent") is Direction(setting)


# ---- what a push request's answer means --------------------------------------------------------------------
def reply(status: str, message: str = "") -> PushReply:
    """A push reply of ``status``."""
    return PushReply(protocol_version=PROTOCOL_VERSION, status=status, message=message)  # type: ignore[arg-type]


def test_accepted_is_no_failure() -> None:
    assert failure_of_push(reply("accepted"), "req") is None


@pytest.mark.parametrize(("status", "kind", "named"), [
    ("expired", FailureKind.LEASE_EXPIRED, "lease expired"),
    ("not_held", FailureKind.NOT_HELD, "no longer holds request 'req'"),
    ("unknown", FailureKind.NOT_HELD, "never held request 'req'"),
    ("busy", FailureKind.TRANSFER, "busy: 256 WRITEs already wait"),
])
def test_every_other_status_fails_the_pull_without_a_retry(status: str, kind: FailureKind, named: str) -> None:
    message = {"busy": "256 WRITEs already wait", "refused": "source_rows: outside"}.get(status, "")
    got = failure_of_push(reply(status, message), "req")
    assert got is not None
    assert got[0] is kind and named in got[1] and got[2] is False, got


def test_refused_rows_retry_after_a_new_handshake() -> None:
    """Rows or agent refused: planned on an incarnation of the prefill rank that is gone (a restart)."""
    got = failure_of_push(reply("refused", "source_rows: outside"), "req")
    assert got is not None
    assert got[0] is FailureKind.REFUSED and "refused the push: source_rows: outside" in got[1] and got[2] is True


def test_a_refused_stream_request_fails_without_a_retry() -> None:
    """A stream id gets one destination: asking again could only be refused again (and dropping the peer would make
    every other pull to it handshake again)."""
    got = failure_of_push(reply("refused", "the prefill request of stream x stopped before this destination came"),
                          "x", retried=STREAM.retried)
    assert got is not None and got[0] is FailureKind.REFUSED and got[2] is False, got


def test_a_refused_request_fails_without_a_retry() -> None:
    """The side channel refused the request itself (another engine, a stale request, no push support)."""
    exc = RemoteRefusedError("malformed", "type", "this side channel takes no push requests; use transfer_mode pull")
    kind, why, retry = failure_of_push(exc, "req")  # type: ignore[misc]
    assert (kind, retry) == (FailureKind.REFUSED, False) and "use transfer_mode pull" in why


@pytest.mark.parametrize("exc", [HandshakeTimeoutError("no reply within 1 s"), ConnectionResetError("reset"),
                                 MalformedMessageError("answered with MetadataReply", field="type"),
                                 HandshakeCancelledError("cancelled")],
                         ids=["timeout", "connection", "bad_reply", "cancelled"])
def test_no_answer_retries_as_a_transfer_failure(exc: Exception) -> None:
    """No reply (the prefill engine may have restarted): the pull may retry once after a re-handshake."""
    kind, why, retry = failure_of_push(exc, "req")  # type: ignore[misc]
    assert (kind, retry) == (FailureKind.TRANSFER, True) and str(exc) in why
