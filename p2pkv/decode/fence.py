"""Fencing READs: does the prefill rank hold these blocks for this request, before and after the READ?

A prefill hold can end (and vLLM reuse the blocks) while a READ is in
flight; the bytes pulled would then be some other request's KV, served with
HTTP 200. And a pull can name blocks the prefill engine does not hold for
that request at all (a repeated or forged ``kv_transfer_params``). So the
decode worker asks each prefill rank (one :class:`handshake.HoldQuery`
per rank and step, off the engine thread, naming the request ids and the
block ids read) twice: when it posts the READs, to fail a pull of blocks no
longer held at once, and after the READs are done, to confirm the hold
lasted through them (with ``verify_kv``, the first question also asks for the digest of the
rows it READs, and the one after the READ too when no held answer has brought it yet:
:mod:`p2pkv.decode.verify`). Only confirmed pulls reach vLLM. A question after the
READ that gets no reply within the side channel's timeout is asked again
(:data:`FENCE_ATTEMPTS` in all, in one call), and a reply to either answers
it: one that comes late, while the next waits, is an answer all the same.
"""

from __future__ import annotations

import enum
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from handshake import HoldLink, HoldsReply, query_holds
from p2pkv.decode.background import Background
from p2pkv.decode.failures import FailureKind
from p2pkv.decode.transfer import Part, TransferState

if TYPE_CHECKING:
    from p2pkv.decode.peers import PeerId

FENCE_EXTEND_S = 10.0
"""Lease extension (seconds) a fence question asks for: the notification follows within a step."""

FENCE_ATTEMPTS = 2
"""Times a question after the READ is asked (each waiting ``timeout_s``) before the pull fails ``unconfirmed``;
a reply to any of them answers it (:func:`handshake.query_holds`)."""


class Phase(str, enum.Enum):
    """When a READ is fenced."""

    BEFORE = "before"
    """Posted now: fail early if the blocks are not held."""
    AFTER = "after"
    """Seen done: the hold lasted through the READ."""


class Hold(str, enum.Enum):
    """What the prefill rank said of one READ's request and blocks."""

    HELD = "held"
    """Still held, its block ids among the held ones: what the READ read stayed the request's."""
    EXPIRED = "expired"
    """Its lease ran out before the answer: the blocks may have been reused, so the READ counts as failed."""
    NOT_HELD = "not_held"
    """Released already (notified or released), or the hold has other block ids."""
    UNKNOWN = "unknown"
    """The prefill rank was never told to hold it (a restarted process, or ids it never had)."""


def hold_of(request_id: str, reply: HoldsReply) -> Hold:
    """What ``reply`` says of ``request_id``."""
    if request_id in reply.expired:
        return Hold.EXPIRED
    if request_id in reply.not_held:
        return Hold.NOT_HELD
    return Hold.UNKNOWN if request_id in reply.unknown else Hold.HELD


class Fence:
    """Batches fence questions per prefill rank and collects the answers.

    Args:
        background: where the side-channel calls run.
        engine_id: this (decode) engine's id.
        secret: side-channel HMAC key, or None.
        timeout_s: wait for each reply (seconds).
    """

    def __init__(self, background: Background, engine_id: str, secret: bytes | None, timeout_s: float) -> None:
        self.background, self.engine_id, self.secret, self.timeout_s = background, engine_id, secret, timeout_s
        self._batches: dict[PeerId, tuple[str, int, list[tuple[Part, Phase]]]] = {}
        self._in_flight: list[tuple[Future, list[tuple[Part, Phase]], dict[str, Any]]] = []
        self._links: dict[tuple[str, int], HoldLink] = {}

    def add(self, read: Part, phase: Phase) -> None:
        """Queue a question about ``read`` for its prefill rank in this step's batch."""
        pid = read.peer_id
        self._batches.setdefault(pid, (pid.host, pid.port, []))[2].append((read, phase))

    def send(self) -> None:
        """Ask every prefill rank with queued questions (one call per rank).

        A batch that cannot even be sent is answered with the exception it
        raised (its pulls are judged on that), never stopping the others.
        """
        batches, self._batches = self._batches, {}
        for pid, (host, port, entries) in batches.items():
            times: dict[str, Any] = {"queued": time.time()}
            try:
                future = self._ask(pid, host, port, entries, times)
            except Exception as exc:  # answered with it
                future = Future()
                future.set_exception(exc)
            self._in_flight.append((future, entries, times))

    def _ask(self, pid: PeerId, host: str, port: int, entries: list[tuple[Part, Phase]],
             times: dict[str, Any]) -> Future:
        """Send one batch of questions to prefill rank ``pid`` on its lane; the answer's Future. ``times`` gets
        when the question left (``sent``) and when its answer came or the wait ended (``answered``)."""
        ids = [r.transfer.spec.remote.request_id for r, _ in entries]
        blocks = [list(r.transfer.spec.remote.block_ids) for r, _ in entries]
        link = self.link(host, port)
        attempts = FENCE_ATTEMPTS if any(phase is Phase.AFTER for _, phase in entries) else 1
        return self.background.call(f"p2pkv-fence-{host}:{port}", _timed, times, query_holds, pid.destination, ids,
                                    blocks, self.engine_id, FENCE_EXTEND_S, secret=self.secret,
                                    timeout_s=self.timeout_s, link=link, attempts=attempts, lane=f"{host}:{port}",
                                    digest_rows=[digest_asked(r, phase) for r, phase in entries])

    def link(self, host: str, port: int) -> HoldLink:
        """The long-lived connection to ``host:port`` (opened on first use; push requests share it)."""
        link = self._links.get((host, port))
        if link is None:
            link = self._links[host, port] = HoldLink(host, port, self.secret)
        return link

    def forget(self, host: str, port: int) -> None:
        """Close the connection to ``host:port`` (no peer there any more): on its lane, after the questions
        already queued there, so the engine thread never waits for it; the lane then holds nothing."""
        link = self._links.pop((host, port), None)
        if link is None:
            return
        done = self.background.call(f"p2pkv-fence-close-{host}:{port}", _close_link, link, lane=f"{host}:{port}")
        if done.done() and not done.cancelled() and done.exception() is not None:  # refused: close it here
            link.close()

    def close(self) -> None:
        """Close the connections to the prefill ranks (after the calls on them ended). Idempotent."""
        for link in self._links.values():
            link.close()
        self._links.clear()

    def verdicts(self, now: float, grace_s: float) -> list[tuple[Part, Verdict, Hold | Exception]]:
        """Judge the answers of the current attempts' questions at ``now`` (``time.monotonic()``); those to
        ask again are queued again here (:attr:`Verdict.ASK_AGAIN`), the rest returned (``WAIT``: nothing to do)."""
        out = []
        for read, phase, answer in self.answers():
            transfer = read.transfer
            if read.attempt != transfer.attempt or transfer.state not in (TransferState.READING, TransferState.FENCING):
                continue  # that attempt was abandoned
            verdict = judge(phase, answer, now - transfer.started, grace_s)
            if verdict is Verdict.ASK_AGAIN:
                self.add(read, phase)
            else:
                out.append((read, verdict, answer))
        return out

    def answers(self) -> list[tuple[Part, Phase, Hold | Exception]]:
        """Finished questions: the READ, the phase, and what the prefill rank said (or why it is unknown).

        Each is also recorded in its pull's :attr:`~p2pkv.decode.transfer.Transfer.questions` (when it was queued,
        left, and was answered, and the answer)."""
        out: list[tuple[Part, Phase, Hold | Exception]] = []
        pending = []
        for future, entries, times in self._in_flight:
            if not future.done():
                pending.append((future, entries, times))
                continue
            try:
                reply: HoldsReply | Exception = future.result()
            except Exception as exc:
                reply = exc
            for i, (read, phase) in enumerate(entries):
                answer = reply if isinstance(reply, Exception) else hold_of(read.transfer.spec.remote.request_id, reply)
                if answer is Hold.HELD and digest_asked(read, phase):  # held: its digest, b"" if none came
                    read.digest = reply.digests[i] if i < len(reply.digests) else b""  # type: ignore[union-attr]
                out.append((read, phase, answer))
                asked = times["queued"]
                read.transfer.questions.append({"phase": phase.value, "queued": asked, "sent": times.get("sent", asked),
                                            "answered": times.get("answered", asked), "answer": _said(answer)})
        self._in_flight = pending
        return out


def digest_asked(read: Part, phase: Phase) -> bytes:
    """The rows whose digest the question about ``read`` asks for (verified KV): the prefill rank's side of the
    READ (its ``remote_descs``, wire form) when its transfer is verified, in the question when it is posted (the
    prefill rank digests while the READ is in flight) and, if no held answer has brought the digest yet, in the
    question after it; else ``b""``."""
    if not read.transfer.verify or (phase is Phase.AFTER and read.digest is not None):
        return b""
    return read.remote_descs.astype("<u8", copy=False).tobytes()


class Verdict(str, enum.Enum):
    """What to do with one fence answer."""

    WAIT = "wait"
    """Nothing now: held when posted, or a question before the READ got no answer (the one after settles it)."""
    ASK_AGAIN = "ask_again"
    """Ask again: the prefill rank does not know the hold yet."""
    CONFIRMED = "confirmed"
    """Held through the READ."""
    FAIL = "fail"
    """Not held, expired, or no reply to the question after the READ (asked :data:`FENCE_ATTEMPTS` times):
    the pull fails (see :func:`failure_of`)."""


def judge(phase: Phase, answer: Hold | Exception, waited_s: float, grace_s: float) -> Verdict:
    """The verdict on ``answer`` to a ``phase`` question, ``waited_s`` seconds after the READ was posted
    (``UNKNOWN`` is asked again for ``grace_s``)."""
    if isinstance(answer, Exception):
        return Verdict.WAIT if phase is Phase.BEFORE else Verdict.FAIL
    if answer is Hold.UNKNOWN and waited_s < grace_s:
        return Verdict.ASK_AGAIN  # the prefill worker may not have been told of the hold yet
    if answer is not Hold.HELD:
        return Verdict.FAIL
    return Verdict.CONFIRMED if phase is Phase.AFTER else Verdict.WAIT


def failure_of(answer: Hold | Exception, request_id: str,
               questions: list[dict[str, Any]] | None = None) -> tuple[FailureKind, str]:
    """The failure kind and reason for an answer judged :attr:`Verdict.FAIL` (an unanswered one with the times
    of the pull's ``questions``, :func:`describe_questions`)."""
    if isinstance(answer, Exception):
        when = f" ({describe_questions(questions)})" if questions else ""
        return FailureKind.UNCONFIRMED, (f"could not confirm that the prefill engine still held the blocks: "
                                         f"{answer}{when}")
    if answer is Hold.EXPIRED:
        return FailureKind.LEASE_EXPIRED, ("the prefill lease expired before the pull finished; its blocks may "
                                           "have been reused (raise lease_s or check the lease heartbeats)")
    if answer is Hold.UNKNOWN:
        return FailureKind.NOT_HELD, (f"the prefill engine never held request {request_id!r}; check that "
                                      "kv_transfer_params come unchanged from that prefill engine")
    return FailureKind.NOT_HELD, (f"the prefill engine no longer holds request {request_id!r} with these "
                                  "remote_block_ids (already pulled and released, released after a failed "
                                  "decode, or block ids of another request); prefill the prompt again")


def describe_questions(questions: list[dict[str, Any]]) -> str:
    """Where each fence question's time went (milliseconds): waiting for its lane, then on the wire and at the
    prefill rank (the prefill rank's side of it is logged at DEBUG on ``p2pkv.handshake.timing``)."""
    parts = []
    for q in questions:
        sent = q["sent"]
        parts.append(f"{q['phase']}-READ question at {q['queued']:.3f}: {(sent - q['queued']) * 1e3:.1f} ms waiting "
                     f"for its lane, {(q['answered'] - sent) * 1e3:.1f} ms until {q['answer']}")
    return "; ".join(parts)


def _said(answer: Hold | Exception) -> str:
    """An answer as the pull's record shows it."""
    return answer.value if isinstance(answer, Hold) else f"no answer ({type(answer).__name__})"


def _timed(times: dict[str, Any], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, with when it began (``times["sent"]``) and ended (``times["answered"]``,
    ``time.time()``)."""
    times["sent"] = time.time()
    try:
        return fn(*args, **kwargs)
    finally:
        times["answered"] = time.time()


def _close_link(link: HoldLink, cancel: threading.Event | None = None) -> None:
    """Close ``link`` (a lane call: ``cancel`` is not needed, closing never blocks for long)."""
    link.close()
