"""The decode-side pull lifecycle: handshake, plan, post READs, poll, fence, notify, retry, fail.

:class:`Puller` owns every pull of one decode worker and is the only code
that moves a pull between its states (:class:`p2pkv.decode.pull.PullState`)::

    HANDSHAKE ──► STAGING ──► READING ──► FENCING ──► DONE
        │  ▲          │           │           │
        │  └──────────┴─ retry ◄──┤(peer failed, once per pull)
        └────────────┴────────────┴───────────┴──► FAILED

In push mode (:mod:`p2pkv.decode.direction`) a prefill rank WRITEs its share
instead of this rank READing it (:mod:`p2pkv.decode.pushes`): the part waits
in ``READING`` for the WRITE's notification, and needs no fence (the prefill
rank keeps the hold until its WRITE has ended).

Each engine step :meth:`Puller.step` finishes handshakes, polls READs and
collects fence answers, and so does a thread between steps while READs are in
flight or answers arrive (:mod:`p2pkv.decode.progress`); a pull that fails marks its local blocks as load
errors and is still reported as received, so vLLM recomputes or fails the
request per ``kv_load_failure_policy``.

Every request's ``kv_transfer_params`` are anyone's choice, so each pull is
contained: an exception while advancing one pull fails that pull alone
(``refused``, the exception in the reason), every waiting state has a
deadline (:mod:`p2pkv.decode.deadlines`), and the peers it makes the worker
keep are bounded (``max_peers``, ``peer_idle_s``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from handshake import KVLayoutDesc, PushReply
from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.dataplane.layout import KVLayout
from p2pkv.dataplane.negotiate import ModelInfo, PullRefused, total_heads
from p2pkv.dataplane.plan import PlanError
from p2pkv.dataplane.stager import Stager
from p2pkv.dataplane.staging import StagingFull
from p2pkv.dataplane.topology import RankRead, TopologyError, notifiers_of, notify_ranks, read_plan
from p2pkv.dataplane.transport import TransportReport
from p2pkv.decode.background import Background
from p2pkv.decode.deadlines import Deadlines
from p2pkv.decode.direction import Choice, Direction, choose
from p2pkv.decode.failures import FailureKind
from p2pkv.decode.fence import Fence, Hold, Phase, Verdict, failure_of, judge
from p2pkv.decode.keeper import PeerKeeper
from p2pkv.decode.notifier import Notifier
from p2pkv.decode.outcomes import Outcomes
from p2pkv.decode.peers import PeerId, PeerTable
from p2pkv.decode.progress import Progress
from p2pkv.decode.pull import Pull, PullState, ReadPart
from p2pkv.decode.pushes import Pushes, failure_of_push
from p2pkv.decode.reads import ReadEvent, abandon, plan_reads, poll_read, release_unposted
from p2pkv.decode.release import release_failed
from p2pkv.decode.spans import PullSpans
from p2pkv.metadata import PullSpec
from p2pkv.telemetry.stats import StatsBuffer, append_json_line

logger = logging.getLogger("p2pkv.decode")


class Puller:
    """Every pull of one decode rank.

    Args:
        engine_id / tp_rank / tp_size: this rank.
        config: p2pkv settings (timeouts, secret, stats file).
        agent: the rank's NIXL agent, KV memory registered.
        layout / desc: the local KV layout and its wire description.
        device_id: GPU index of the KV cache (0 for DRAM).
        stager: the staging area for pulls that need a fixup.
        compat_hash / stats: what handshakes must match; the worker's statistics, appended to.
        model: this engine's model facts that limit pairings (window, KV cache groups).
    """

    def __init__(self, engine_id: str, tp_rank: int, tp_size: int, config: P2pKvConfig, agent: NixlTransferAgent,
                 layout: KVLayout, desc: KVLayoutDesc, device_id: int, stager: Stager, compat_hash: str,
                 stats: StatsBuffer, model: ModelInfo | None = None) -> None:
        self.engine_id, self.tp_rank, self.tp_size, self.config = engine_id, tp_rank, tp_size, config
        self.agent, self.layout, self.desc, self.device_id, self.stager = agent, layout, desc, device_id, stager
        self.compat_hash, self.stats, self._secret = compat_hash, stats, config.secret_bytes()
        self.progress = Progress(self._advance, f"p2pkv-pulls-tp{tp_rank}", config.pull_poll_interval_s,
                                 on_start=lambda: bind_device(desc.mem_type, device_id))
        self.lock = self.progress.lock
        self.background = Background(on_done=self.progress.wake)
        self.peers = PeerTable(agent, desc, list(layout.segments), tp_rank, tp_size, model)
        self.fence = Fence(self.background, engine_id, self._secret, config.handshake_timeout_s)
        self.keeper = PeerKeeper(self.peers, self.fence, self.background, engine_id=engine_id,
                                 compat_hash=compat_hash, secret=self._secret, config=config)
        self.deadlines = Deadlines.of(config)
        self.pulls: list[Pull] = []
        self._staging_wait: list[Pull] = []
        self._handshake_wait: dict[PeerId, list[Pull]] = {}
        self._draining: list[tuple[ReadPart, float]] = []  # cancelled READs NIXL would not release, deadline
        self.outcomes = Outcomes()  # reported to vLLM at the next get_finished
        self.spans = PullSpans.start(config, engine_id, tp_rank, agent)  # None: tracing off
        self.notifier = Notifier(agent, self.peers, f"{engine_id}:{tp_rank}", self._secret, self.spans)
        self.pushes = Pushes(self.background, self.fence, agent, engine_id, self._secret, config.handshake_timeout_s,
                             config.transfer_timeout_s)
        self.choices: dict[str, Choice] = {}  # prefill agent name → its direction (config or UCX's report)

    # ---- public surface -----------------------------------------------------
    def start(self, specs: list[PullSpec], failed: dict[str, tuple[int, ...]] | None = None) -> None:
        """Take this step's new pulls (after those that waited for staging), and the pulls the
        scheduler could not set up (``failed``: request id → local blocks, reported failed)."""
        with self.lock:
            for request_id, blocks in (failed or {}).items():
                self.outcomes.add(request_id, blocks, failed=True)
                self.stats.record_failure(FailureKind.REFUSED.value)
            new, waiting, self._staging_wait = [Pull.taken(spec) for spec in specs], self._staging_wait, []
            self.pulls += new
            for pull in [*waiting, *new]:
                self._contained(pull, "starting the pull", self._begin, pull)
            if new or waiting:  # poll the READs and send fence questions now: the pulls' thread may wait
                self._advance()
        self.progress.wake()

    def step(self) -> set[str]:
        """Advance every pull; the request ids finished (loaded or failed) since the last call."""
        with self.lock:
            try:
                self._advance()
            finally:  # from the engine thread, which keeps progressing NIXL's sends
                self.notifier.send(self._contained)
            return self.outcomes.take_finished()

    def _advance(self) -> bool:
        """Move every pull as far as it can go now; True while a READ is in flight (poll again soon).

        Each phase is contained: one that raises is logged and the others still run.
        """
        for what, phase in (("finishing handshakes", self._finish_handshakes),
                            ("collecting pushes", self._collect_pushes), ("draining", self._drain),
                            ("polling READs", self._poll_reads), ("collecting fence answers", self._collect_fence),
                            ("checking deadlines", self._expire), ("asking fence questions", self.fence.send),
                            ("dropping idle peers", lambda: self.keeper.drop_idle(self._busy_peers))):
            self._contained(None, what, phase)
        return bool(self._draining) or any(r.in_flight and (r.stage is None or r.push_id)
                                           for p in self.in_state(PullState.READING) for r in p.reads)

    def _contained(self, pull: Pull | None, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)``, one step of ``pull`` (None: of the worker); an exception is logged and fails
        that pull alone (``refused``, the exception in the reason), never the others."""
        try:
            fn(*args)
        except Exception as exc:
            logger.exception("p2pkv: %s failed%s", what, f" (request {pull.request_id})" if pull else "")
            if pull is None or pull.finished:
                return
            try:
                self._abandon(pull)  # READs in flight must not land in blocks handed back to vLLM
            except Exception:
                logger.exception("p2pkv: cancelling the READs of %s failed", pull.request_id)
            self._fail(pull, FailureKind.REFUSED, f"unexpected error {what}: {exc!r}")

    @property
    def busy(self) -> bool:
        """True while a pull is under way (taken and not yet handed to vLLM as finished)."""
        return bool(self.pulls or self._staging_wait or self.outcomes.finished)

    def take_load_errors(self) -> set[int]:
        """Local block ids whose pull failed since the last call."""
        with self.lock:
            return self.outcomes.take_load_errors()

    def take_failed(self) -> set[str]:
        """Request ids among those :meth:`step` handed out since the last call whose pull failed."""
        with self.lock:
            return self.outcomes.take_failed()

    def in_state(self, state: PullState) -> list[Pull]:
        """Pulls now in ``state``."""
        with self.lock:
            return [p for p in self.pulls if p.state is state]

    def close(self) -> None:
        """Stop the progress thread, cancel side-channel calls and READs in flight. Idempotent."""
        self.progress.close()
        self.background.close()
        self.fence.close()
        with self.lock:
            for read in [r for pull in self.pulls for r in pull.reads if r.in_flight and r.handle is not None]:
                self.agent.cancel(read.handle)
            self.pulls.clear()

    # ---- transitions ----------------------------------------------------------
    def _to(self, pull: Pull, state: PullState) -> None:
        if state is not pull.state:
            pull.state, pull.since = state, time.monotonic()  # its deadline counts from here
        if pull.finished:
            self.peers.touch(pull.peers)  # idle from now on
            if pull in self.pulls:
                self.pulls.remove(pull)
            if not pull.draining:
                _report(self.outcomes, pull)

    def _begin(self, pull: Pull) -> None:
        """Map the TP topology, then wait for handshakes or start the READs."""
        spec = pull.spec
        if (why := _refusal(spec, self.engine_id)) is not None:
            self._fail(pull, FailureKind.REFUSED, why)
            return
        try:
            reads, notify = topology(self.desc, self.tp_rank, self.tp_size, spec.remote.tp_size)
        except PullRefused as exc:
            self._fail(pull, FailureKind.REFUSED, f"refused: {exc}")
            return
        ranks = {r.remote_rank for r in reads} | set(notify)
        ids = sorted(PeerId.of(spec.remote, r) for r in ranks)
        pull.peers = tuple(ids)
        self.peers.touch(ids)
        missing = [pid for pid in ids if pid not in self.peers.peers]
        known = next((self.peers.peers[pid].info for pid in ids if pid in self.peers.peers), None)
        if known is not None and known.tp_size != spec.remote.tp_size:
            self._fail(pull, FailureKind.REFUSED, f"kv_transfer_params.tp_size={spec.remote.tp_size}, but prefill "
                                                  f"engine {known.engine_id!r} runs tp_size={known.tp_size}")
            return
        if not missing:
            self._post(pull, reads, notify)
            return
        if not self.keeper.handshake(missing, self._busy_peers()):
            self._fail(pull, FailureKind.REFUSED, f"refused: the pull needs {len(missing)} more prefill rank(s) "
                       f"while max_peers={self.config.max_peers} are known or being handshaken and none can be "
                       "dropped (all in use); raise max_peers in kv_connector_extra_config")
            return
        self._to(pull, PullState.HANDSHAKE)
        self._handshake_wait.setdefault(missing[0], []).append(pull)  # begun again when done; waits for the rest then

    def _finish_handshakes(self) -> None:
        for pid, failure in self.keeper.completed(self.stats.data["handshake_seconds"]):
            for pull in [p for p in self._handshake_wait.pop(pid, []) if not p.finished]:
                if failure is not None:
                    self._contained(pull, "failing the pull", self._fail, pull, *failure)
                else:  # _begin, not _post: a failed start drops the peer for the rest
                    pull.marks["handshaken"] = time.time()
                    self._contained(pull, "starting the pull after its handshake", self._begin, pull)

    def _post(self, pull: Pull, reads: list[RankRead], notify: list[int]) -> None:
        """Plan every READ of ``pull`` and post them (or wait for staging, or finish at once)."""
        spec = pull.spec
        args = (self.tp_size, spec.remote.tp_size, total_heads(self.desc, self.tp_size), self.desc.is_mla)
        pull.notify = [(PeerId.of(spec.remote, r), notifiers_of(r, *args)) for r in notify]
        pull.reads, pull.started, pull.num_bytes, pull.num_descriptors = [], time.monotonic(), 0, 0
        try:
            if not plan_reads(pull, [r.remote_rank for r in reads], self.peers.peers, self.layout, self.desc,
                              self.device_id, self.stager):
                self._to(pull, PullState.STAGING)
                self._staging_wait.append(pull)
                return
        except (PlanError, StagingFull) as exc:
            release_unposted(pull, self.stager)
            if isinstance(exc, PlanError):
                self._fail(pull, FailureKind.BAD_BLOCK_IDS, f"bad block ids: {exc}")
            else:
                self._fail(pull, FailureKind.STAGING, str(exc))
            return
        if not pull.reads:  # nothing to load (or a notify-only pull)
            self.notifier.add(pull)
            self._to(pull, PullState.DONE)
            return
        self._to(pull, PullState.READING)
        for read in pull.reads:
            try:
                if self.direction(pull, read) is Direction.PUSH:
                    self.pushes.post(read)
                    continue
                read.handle = self.agent.start_read(read.peer.agent_name, read.local_descs, read.remote_descs)
            except Exception as exc:
                self._abandon(pull)
                self.peers.drop(read.peer_id)
                self._retry_or_fail(pull, _kind(exc), f"pull from {read.peer.agent_name} could not start: {exc}")
                return
            self.fence.add(read, Phase.BEFORE)
        pull.marks["posted"] = time.time()

    def direction(self, pull: Pull, read: ReadPart) -> Direction:
        """Pull or push ``read``: the request's ``p2pkv_transfer_mode`` if it names one, else the peer's choice."""
        wanted = pull.spec.remote.transfer_mode
        if wanted in ("pull", "push"):
            return Direction(wanted)
        name = read.peer.agent_name
        if name not in self.choices:
            self._choose(name, choose(self.config.transfer_mode, None))
        return self.choices[name].direction

    def on_transport(self, report: TransportReport) -> None:
        """UCX said how one peer's READs move: under ``auto``, that decides the peer's direction from now on."""
        if self.config.transfer_mode == "auto":
            self._choose(report.peer, choose("auto", report))

    def _choose(self, name: str, choice: Choice) -> None:
        """Record a peer's direction; logged when it is new or changes."""
        if self.choices.get(name) != choice:
            logger.info("p2pkv: %s from prefill agent %s (%s)", choice.direction.value, name, choice.reason)
        self.choices[name] = choice

    def _collect_pushes(self) -> None:
        """Push replies (a refusal fails the pull as the fence would) and WRITE notifications."""
        now = time.monotonic()
        self.pushes.send_due(now)
        for read, reply in self.pushes.replies():
            pull = read.pull
            if read.attempt != pull.attempt or pull.finished:
                continue
            if (isinstance(reply, PushReply) and reply.status == "unknown"
                    and self.pushes.unknown_for(read, now) < self.config.handshake_timeout_s):
                self.pushes.again(read)  # the prefill worker may not have been told of the hold yet
                continue
            why = failure_of_push(reply, pull.spec.remote.request_id)
            if why is not None:
                self._contained(pull, "failing a pushed pull", self._push_failed, pull, *why)
        for read, note in self.pushes.arrivals(now):
            read.arrived, read.failure = note.ok, note.reason
        self.progress.wake()

    def _push_failed(self, pull: Pull, kind: FailureKind, why: str, retry: bool) -> None:
        self._abandon(pull)
        if retry:
            self._retry_or_fail(pull, kind, why)
        else:
            self._fail(pull, kind, why)

    def _drain(self) -> None:
        """Report pulls whose cancelled READs have ended (or waited out ``transfer_timeout_s``)."""
        self._draining = _wait_out(self._ended, self.outcomes, self._draining)

    def _ended(self, read: ReadPart) -> bool:
        """True once a given-up READ or push can write nothing more."""
        if read.push_id:
            return self.pushes.ended(read)
        try:
            return self.agent.poll(read.handle)
        except Exception:
            return True

    def _poll_reads(self) -> None:
        now = time.monotonic()
        for pull in self.in_state(PullState.READING):
            self._contained(pull, "polling the READs", self._poll_pull, pull, now)
        self.stager.poll_releases()

    def _poll_pull(self, pull: Pull, now: float) -> None:
        for read in pull.reads:
            if pull.state is not PullState.READING or read.attempt != pull.attempt:
                break  # abandoned (or retried) during this loop
            if read.in_flight and (read.stage is None or not self.progress.on_thread()):
                self._poll(pull, read, now)  # a staged READ's fixup runs at the engine step
        if pull.state is PullState.READING and all(r.done for r in pull.reads):
            pull.marks["read"] = time.time()
            self._to(pull, PullState.FENCING)
            self._confirm_if_done(pull)

    def _poll(self, pull: Pull, read: ReadPart, now: float) -> None:
        """Poll one READ; still in flight past ``transfer_timeout_s``, :meth:`_expire` gives it up."""
        event, exc = poll_read(self.agent, self.stager, read, now)
        if event is ReadEvent.FAILED:
            self.peers.drop(read.peer_id, only=read.peer)
            self._abandon(pull)
            self._retry_or_fail(pull, _kind(exc), str(exc))
        elif event is ReadEvent.FIXUP_FAILED:
            self._abandon(pull)
            self._fail(pull, FailureKind.FIXUP, f"fixup after the READ failed: {exc!r}")
        elif event is ReadEvent.DONE and read.push_id:
            read.confirmed = True  # the prefill rank kept the hold until its WRITE ended
        elif event is ReadEvent.DONE:
            self.fence.add(read, Phase.AFTER)

    def _collect_fence(self) -> None:
        now = time.monotonic()
        for read, phase, answer in self.fence.answers():
            self._contained(read.pull, "judging a fence answer", self._judge, read, phase, answer, now)

    def _judge(self, read: ReadPart, phase: Phase, answer: Hold | Exception, now: float) -> None:
        """Act on one fence answer about ``read``."""
        pull = read.pull
        if read.attempt != pull.attempt or pull.state not in (PullState.READING, PullState.FENCING):
            return  # that attempt was abandoned
        verdict = judge(phase, answer, read.unanswered, now - pull.started, self.config.handshake_timeout_s)
        if verdict is Verdict.ASK_AGAIN:
            read.unanswered += isinstance(answer, Exception)  # a busy prefill engine may miss one
            self.fence.add(read, phase)
        elif verdict is Verdict.FAIL:
            self._abandon(pull)
            self._fail(pull, *failure_of(answer, pull.spec.remote.request_id))
        elif verdict is Verdict.CONFIRMED:
            read.confirmed = True
            self._confirm_if_done(pull)

    def _confirm_if_done(self, pull: Pull) -> None:
        """``FENCING`` with every part confirmed: the pull is done (recorded, prefill ranks to notify)."""
        if pull.state is PullState.FENCING and all(r.confirmed for r in pull.reads):
            pull.marks["confirmed"] = time.time()
            _record(pull, self.stats, self.config.stats_file)
            self.notifier.add(pull)
            self._to(pull, PullState.DONE)

    # ---- endings ----------------------------------------------------------------
    def _abandon(self, pull: Pull) -> None:
        """Stop a failing pull's READs in flight (:func:`p2pkv.decode.reads.abandon`); those NIXL keeps are
        waited out before the pull is reported."""
        self._draining += abandon(pull, self.agent, self.stager, self.config.transfer_timeout_s,
                                  self.pushes.drain_deadline)

    def _retry_or_fail(self, pull: Pull, kind: FailureKind, why: str) -> None:
        """After a peer failure: re-handshake (the prefill may have restarted) and retry once per pull."""
        if pull.attempt > 1:
            self._fail(pull, kind, why)
            return
        logger.warning("p2pkv: %s; re-handshaking and retrying request %s once", why, pull.request_id)
        self._begin(pull)

    def _expire(self) -> None:
        """Fail every pull past its state's deadline (``timeout``)."""
        now = time.monotonic()
        for pull in list(self.pulls):
            if not pull.finished and (why := self.deadlines.overdue(pull, now)) is not None:
                self._abandon(pull)
                self._fail(pull, FailureKind.TIMEOUT, why)

    def _fail(self, pull: Pull, kind: FailureKind, why: str) -> None:
        """Report a pull as failed: its local blocks become load errors, the request finishes. Once per pull."""
        if pull.finished:
            return
        spec, handshaking = pull.spec, pull.state is PullState.HANDSHAKE
        if _log_failure(spec, kind, why):
            self.stats.record_failure(kind.value)
        if pull in self._staging_wait:
            self._staging_wait.remove(pull)
        self._to(pull, PullState.FAILED)
        if self.spans is not None:
            self._contained(None, "tracing a pull", self.spans.ended, pull, (kind, why))
        if handshaking:  # the handshakes no other pull waits for are not started (a running one ends by itself)
            for pid in self.peers.cancel_unneeded(self._handshaking()):
                self._handshake_wait.pop(pid, None)
        release_failed(self.background, spec.remote, _answered_ranks(self.desc, self.tp_rank, self.tp_size, spec),
                       f"{self.engine_id}:{self.tp_rank}", self._secret, self.config.handshake_timeout_s)

    # ---- peers ------------------------------------------------------------------------
    def _busy_peers(self) -> set[PeerId]:
        """Peers a pull under way, a cancelled READ or a notification still needs (never dropped)."""
        return ({pid for p in self.pulls for pid in p.peers} | {r.peer_id for r, _ in self._draining}
                | self.notifier.needed_peers())

    def _handshaking(self) -> set[PeerId]:
        """Peers the pulls waiting in ``HANDSHAKE`` need."""
        return {pid for p in self.pulls if p.state is PullState.HANDSHAKE for pid in p.peers}


def _wait_out(ended: Callable[[ReadPart], bool], outcomes: Outcomes,
              draining: list[tuple[ReadPart, float]]) -> list[tuple[ReadPart, float]]:
    """Wait out cancelled READs NIXL would not release and open pushes (until ``ended`` or their deadline),
    then report their pulls; returns the parts still draining."""
    now, keep = time.monotonic(), []
    for read, deadline in draining:
        if not ended(read) and now < deadline:
            keep.append((read, deadline))
            continue
        read.pull.draining -= 1
        if read.pull.finished and not read.pull.draining:
            _report(outcomes, read.pull)
    return keep


def _report(outcomes: Outcomes, pull: Pull) -> None:
    """Hand an ended pull to vLLM: finished receiving, and for a failed one its blocks as load errors."""
    outcomes.add(pull.request_id, pull.spec.local_block_ids, failed=pull.state is PullState.FAILED,
                 report=pull.spec.report)


def _log_failure(spec: PullSpec, kind: FailureKind, why: str) -> bool:
    """Log a failed pull; False (a warning only, not a pull failure) for a request that ended before its pull."""
    if spec.report or spec.local_block_ids:
        logger.error("p2pkv: pull failed kind=%s request=%s remote_request=%s peer=%s:%d blocks=%d reason=%s",
                     kind.value, spec.request_id, spec.remote.request_id, spec.remote.host, spec.remote.port,
                     len(spec.local_block_ids), why)
        return True
    logger.warning("p2pkv: request %s ended before its pull; could not tell %s:%d to free %s now (its lease frees "
                   "it): %s", spec.request_id, spec.remote.host, spec.remote.port, spec.remote.request_id, why)
    return False


def _record(pull: Pull, stats: StatsBuffer, stats_file: str) -> None:
    """Count a finished pull (all its READs) in the stats and, if configured, the stats file."""
    spec, seconds = pull.spec, max(r.done for r in pull.reads) - pull.started
    direction = "push" if any(r.push_id for r in pull.reads) else "pull"
    stats.record_pull(pull.num_bytes, seconds, pull.num_descriptors, direction)
    stats.record_phases(pull.marks)
    if stats_file:
        append_json_line(stats_file, {
            "request_id": spec.request_id, "remote_request_id": spec.remote.request_id,
            "peer": ",".join(r.peer.agent_name for r in pull.reads), "blocks": len(spec.local_block_ids),
            "bytes": pull.num_bytes, "descriptors": pull.num_descriptors, "seconds": seconds, "direction": direction,
            "marks": pull.marks})


def _refusal(spec: PullSpec, engine_id: str) -> str | None:
    """Why ``spec`` is refused before anyone is contacted, or None.

    Params naming this engine itself; params with a string UTF-8 cannot
    encode (a lone surrogate): such a pull could be neither fenced nor
    notified, and would fail the fence questions it is batched with.
    """
    if spec.remote.engine_id == engine_id:
        return (f"refused: kv_transfer_params.remote_engine_id={spec.remote.engine_id!r} is this engine: the "
                "request was prefilled here; send its prefill leg to another engine (a proxy's --prefill and "
                "--decode must differ)")
    for key, text in (("remote_engine_id", spec.remote.engine_id), ("remote_request_id", spec.remote.request_id),
                      ("remote_host", spec.remote.host)):
        try:
            text.encode()
        except UnicodeEncodeError:
            return f"refused: kv_transfer_params.{key} is not valid UTF-8"
    return None


def _kind(exc: BaseException) -> FailureKind:
    """``DISCONNECT`` when NIXL said the peer went away, else ``TRANSFER``."""
    return FailureKind.DISCONNECT if isinstance(exc, TransferError) and exc.disconnected else FailureKind.TRANSFER


def _answered_ranks(desc: KVLayoutDesc, tp_rank: int, tp_size: int, spec: PullSpec) -> list[int]:
    """Prefill ranks this decode rank tells about ``spec`` (all of them when the TP sizes cannot pair)."""
    try:
        return topology(desc, tp_rank, tp_size, spec.remote.tp_size)[1]
    except PullRefused:
        return list(range(spec.remote.tp_size))


def topology(desc: KVLayoutDesc, tp_rank: int, tp_size: int, remote_tp: int) -> tuple[list[RankRead], list[int]]:
    """The prefill ranks decode rank ``tp_rank`` reads (with head slices) and notifies.

    Raises:
        PullRefused: the heads cannot be mapped between the two TP sizes.
    """
    args = (tp_rank, tp_size, remote_tp, total_heads(desc, tp_size), desc.is_mla)
    try:
        return read_plan(*args), notify_ranks(*args)
    except TopologyError as exc:
        raise PullRefused(f"prefill tp_size={remote_tp}, decode tp_size={tp_size}: {exc}") from exc


def bind_device(mem_type: str, device_id: int) -> None:
    """Make the KV cache's GPU the current device of the calling thread (NIXL and CUDA calls made there
    otherwise go to GPU 0); nothing for host memory."""
    if mem_type == "VRAM":
        import torch

        torch.cuda.set_device(device_id)
