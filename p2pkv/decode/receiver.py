"""The decode-side transfer lifecycle: handshake, plan, post READs, poll, fence, notify, retry, fail.

:class:`Receiver` owns every transfer (:class:`p2pkv.decode.transfer.Transfer`,
called a pull below: READ by this rank or pushed to it) of one decode worker
and is the only code that decides when one moves between its states (:class:`p2pkv.decode.transfer.TransferState`;
:class:`p2pkv.decode.endings.Endings` sets them and ends transfers;
:class:`p2pkv.decode.confirmations.Confirmations` acts on the fence's verdicts)::

    HANDSHAKE ──► STAGING ──► READING ──► FENCING ──► DONE
        │  ▲          │           │           │
        │  └──────────┴─ retry ◄──┤(peer failed, once per pull)
        └────────────┴────────────┴───────────┴──► FAILED

In push mode (:mod:`p2pkv.decode.direction`) a prefill rank WRITEs its share
instead of this rank READing it (:mod:`p2pkv.decode.pushes`): the part waits
in ``READING`` for the WRITE's notification, and needs no fence (the prefill
rank keeps the hold until its WRITE has ended).

Each engine step :meth:`Receiver.step` finishes handshakes, polls READs and
collects fence answers, and so does a thread between steps while READs are in
flight or answers arrive (:mod:`p2pkv.decode.progress`); a pull that fails marks its local blocks as load
errors and is still reported as received, so vLLM recomputes or fails the
request per ``kv_load_failure_policy``.

Every request's ``kv_transfer_params`` are anyone's choice, so each pull is
contained: an exception while advancing one pull fails that pull alone
(``refused``, the exception in the reason), every waiting state has a
deadline (:mod:`p2pkv.decode.deadlines`), and the peers it makes the worker
keep are bounded (:data:`p2pkv.decode.peer_keeping.MAX_PEERS`, :data:`p2pkv.decode.keeper.PEER_IDLE_S`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.dataplane.negotiate import ModelInfo, PairRefused
from p2pkv.dataplane.plan import PlanError
from p2pkv.dataplane.rank import LocalRank
from p2pkv.dataplane.stager import Stager
from p2pkv.dataplane.stages import check_peer_stages
from p2pkv.dataplane.staging import StagingFull
from p2pkv.dataplane.topology import RankRead
from p2pkv.decode import keeper as peer_keeping
from p2pkv.decode import progress as pull_progress
from p2pkv.decode.background import Background
from p2pkv.decode.confirmations import Confirmations
from p2pkv.decode.deadlines import Deadlines
from p2pkv.decode.direction import Directions
from p2pkv.decode.drain import Drain
from p2pkv.decode.endings import Endings
from p2pkv.decode.failures import FailureKind
from p2pkv.decode.fence import Fence
from p2pkv.decode.keeper import PeerKeeper
from p2pkv.decode.movers import movers
from p2pkv.decode.notifier import Notifier
from p2pkv.decode.outcomes import Outcomes
from p2pkv.decode.part_moves import Transfers
from p2pkv.decode.peers import PeerId, PeerTable
from p2pkv.decode.probe import TransportProbe
from p2pkv.decode.progress import Progress
from p2pkv.decode.pull_spans import TransferSpans
from p2pkv.decode.pushes import Pushes
from p2pkv.decode.reads import ReadEvent, release_unposted
from p2pkv.decode.release import release_failed
from p2pkv.decode.transfer import STREAM_POLL_MIN_S, Part, Transfer, TransferState, poll_wait_s, way_of
from p2pkv.faults import load_faults
from p2pkv.metadata import LoadSpec
from p2pkv.telemetry.stats import StatsBuffer
from p2pkv.transfer_threads import parse_cpus, start_transfer_thread

logger = logging.getLogger("p2pkv.decode")


class Receiver:
    """Every transfer (read or pushed) into one decode rank.

    Args:
        rank: this rank (engine id, TP rank and size, KV layout, device).
        config: p2pkv settings (timeouts, stats file, transfer mode).
        agent: the rank's NIXL agent, KV memory registered.
        stager: the staging area for pulls that need a fixup.
        compat_hash: what handshakes must match.
        stats: the worker's statistics, appended to.
        model: this engine's model facts that limit pairings (window, KV cache groups).
        secret: the side-channel key the worker loaded (None: insecure); the
            settings' ``secret_file`` is not read again.
    """

    def __init__(self, rank: LocalRank, config: P2pKvConfig, agent: NixlTransferAgent, stager: Stager,
                 compat_hash: str, stats: StatsBuffer, model: ModelInfo | None = None, *,
                 secret: bytes | None) -> None:
        self.rank = rank
        self.config = config
        self.agent = agent
        self.stager = stager
        self.stats = stats
        self._secret = secret
        self.progress = Progress(self._advance, f"p2pkv-pulls-tp{rank.tp_rank}", pull_progress.INTERVAL_S,
                                 on_start=lambda: start_transfer_thread(rank.desc.mem_type, rank.device_id,
                                                                       parse_cpus(config.transfer_cpus)),
                                 wait_s=lambda: poll_wait_s(self.transfers, time.monotonic(),
                                                            pull_progress.INTERVAL_S, STREAM_POLL_MIN_S))
        self.lock = self.progress.lock
        self.background = Background(on_done=self.progress.wake)
        self.peers = PeerTable(agent, rank.desc, list(rank.layout.segments), rank.tp_rank, rank.tp_size, model)
        self.fence = Fence(self.background, rank.engine_id, self._secret, config.handshake_timeout_s)
        self.keeper = PeerKeeper(self.peers, self.fence, self.background, engine_id=rank.engine_id,
                                 compat_hash=compat_hash, secret=self._secret, config=config)
        self.deadlines = Deadlines.of(config)
        self.transfers: list[Transfer] = []
        self._staging_wait: list[Transfer] = []
        self.outcomes = Outcomes()  # reported to vLLM at the next get_finished
        self.spans = TransferSpans.start(rank.engine_id, rank.tp_rank, agent)  # None: tracing off
        self.notifier = Notifier(agent, self.peers, rank.name, self._secret, self.spans)
        self.pushes = Pushes(self.background, self.fence, agent, rank.engine_id, self._secret,
                             config.handshake_timeout_s, config.transfer_timeout_s, config.stream_window_s)
        self.directions = Directions(config.transfer_mode)
        self.probe: TransportProbe | None = None
        if config.transfer_mode == "auto":  # learn each new peer's READs at once
            self.probe = TransportProbe(agent, stager.device, stager.device_id)
            self.keeper.on_peer = self.probe.run
        ways = movers(agent, stager, self.fence, self.pushes, config.transfer_timeout_s, load_faults())
        self.moves = Transfers(ways, self.directions)
        self.drain = Drain(stager, self.outcomes, ways)
        self.peers.keep_agent = lambda name: agent_in_use(name, self.drain, self.transfers)
        self.endings = Endings(rank, config, self._secret, self.transfers, self._staging_wait, self.outcomes,
                               self.peers, self.keeper, self.drain, self.background, stats, self.spans)
        self.confirmations = Confirmations(self.drain, self.endings, self.notifier, stats, config.stats_file,
                                           rank.desc)

    # ---- public surface -----------------------------------------------------
    def start(self, specs: list[LoadSpec], failed: dict[str, tuple[int, ...]] | None = None,
              ended_streams: list[str] | None = None) -> None:
        """Take this step's new pulls (after those that waited for staging), the pulls the scheduler could
        not set up (``failed``: request id → local blocks, reported failed), and the streamed loads whose
        request has ended (``ended_streams``: one still under way is given up,
        :meth:`p2pkv.decode.endings.Endings.give_up`)."""
        with self.lock:
            ended = set(ended_streams or ())
            for transfer in [t for t in self.transfers if t.request_id in ended and t.way.given_up_at_request_end]:
                self._contained(transfer, "giving the stream up", self.endings.give_up, transfer)
            for request_id, blocks in (failed or {}).items():
                self.outcomes.add(request_id, blocks, failed=True)
                self.stats.record_failure(FailureKind.REFUSED.value)
            for spec in [s for s in specs if _declines(s)]:
                answered = self.rank.answered_ranks(spec.remote.tp_size, spec.remote.pp_size)
                release_failed(self.background, spec.remote, answered, self.rank.name, self._secret,
                               self.config.handshake_timeout_s)
            specs = [s for s in specs if not _declines(s)]
            new = [Transfer.taken(spec, self.config.verify_kv) for spec in specs]
            waiting = self._staging_wait[:]  # begun again below (the list is shared with self.endings)
            self._staging_wait.clear()
            self.transfers += new
            for transfer in [*waiting, *new]:
                self._contained(transfer, "starting the pull", self._begin, transfer)
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
                            ("collecting pushes", self._collect_pushes), ("draining", self.drain.poll),
                            ("polling READs", self._poll_reads), ("collecting fence answers", self._collect_fence),
                            ("checking deadlines", self._expire), ("asking fence questions", self.fence.send),
                            ("dropping idle peers", lambda: self.keeper.drop_idle(self._busy_peers)),
                            ("removing dropped peers' agents", self.peers.sweep)):
            self._contained(None, what, phase)
        flushing = self.progress.on_thread() and self.notifier.send_if_idle(self._contained)
        return flushing or bool(self.drain) or any(r.in_flight and self.moves.mover_of(r).polled_soon(r)
                                                   for p in self.in_state(TransferState.READING) for r in p.parts)

    def _contained(self, transfer: Transfer | None, what: str, fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> None:
        """Run ``fn(*args, **kwargs)``, one step of ``pull`` (None: of the worker); an exception is logged and fails
        that pull alone (``refused``, the exception in the reason), never the others."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            logger.exception("p2pkv: %s failed%s", what, f" (request {transfer.request_id})" if transfer else "")
            if transfer is None or transfer.finished:
                return
            try:
                self.drain.abandon(transfer)  # READs in flight must not land in blocks handed back to vLLM
            except Exception:
                logger.exception("p2pkv: cancelling the READs of %s failed", transfer.request_id)
            self.endings.fail(transfer, FailureKind.REFUSED, f"unexpected error {what}: {exc!r}")

    @property
    def busy(self) -> bool:
        """True while a pull is under way (taken and not yet handed to vLLM as finished)."""
        return bool(self.transfers or self._staging_wait or self.outcomes.finished)

    def take_load_errors(self) -> set[int]:
        """Local block ids whose pull failed since the last call."""
        with self.lock:
            return self.outcomes.take_load_errors()

    def take_failed(self) -> set[str]:
        """Request ids among those :meth:`step` handed out since the last call whose pull failed."""
        with self.lock:
            return self.outcomes.take_failed()

    def in_state(self, state: TransferState) -> list[Transfer]:
        """Pulls now in ``state``."""
        with self.lock:
            return [p for p in self.transfers if p.state is state]

    def close(self) -> None:
        """Stop the progress thread, cancel side-channel calls and READs in flight. Idempotent."""
        self.progress.close()
        self.background.close()
        self.fence.close()
        with self.lock:
            for read in [r for transfer in self.transfers for r in transfer.parts if r.in_flight]:
                self.moves.mover_of(read).stop(read)
            self.transfers.clear()

    # ---- transitions ----------------------------------------------------------
    def _begin(self, transfer: Transfer) -> None:
        """Map the TP topology, then wait for handshakes or start the READs."""
        needs = _needs(transfer.spec, self.rank, self.peers)
        if isinstance(needs, str):
            self.endings.fail(transfer, FailureKind.REFUSED, needs)
            return
        reads, notify, ids = needs
        transfer.peers = tuple(ids)
        self.peers.touch(ids)
        missing = [pid for pid in ids if pid not in self.peers.peers]
        if not missing:
            self._post(transfer, reads, notify)
            return
        if not self.keeper.handshake(missing, self._busy_peers()):
            self.endings.fail(transfer, FailureKind.REFUSED,
                              f"refused: the pull needs {len(missing)} more prefill rank(s) while "
                              f"MAX_PEERS={peer_keeping.MAX_PEERS} are known or being handshaken and none can be "
                              "dropped (all in use)")
            return
        self.endings.to(transfer, TransferState.HANDSHAKE)
        self.keeper.wait(missing[0], transfer)  # begun again when done; waits for the rest then

    def _finish_handshakes(self) -> None:
        for transfer, failure in self.keeper.ready(self.stats.data["handshake_seconds"]):
            if failure is not None:
                self._contained(transfer, "failing the pull", self.endings.fail, transfer, *failure)
            else:  # _begin, not _post: a failed start drops the peer for the rest
                transfer.marks["handshaken"] = time.time()
                self._contained(transfer, "starting the pull after its handshake", self._begin, transfer)

    def _post(self, transfer: Transfer, reads: list[RankRead], notify: list[int]) -> None:
        """Plan every READ of ``pull`` and post them (or wait for staging, or finish at once); a pull from stages
        that do not tile this rank's layers is refused first (:func:`p2pkv.dataplane.stages.check_peer_stages`)."""
        spec = transfer.spec
        try:
            check_peer_stages([self.peers.peers[pid].info for pid in transfer.peers], spec.remote.pp_size,
                              self.rank.desc.num_layers)
        except PairRefused as exc:
            self.endings.fail(transfer, FailureKind.REFUSED, f"refused: {exc}")
            return
        counts = self.rank.notifiers(spec.remote.tp_size, notify)
        transfer.notify = [(PeerId.of(spec.remote, r), n) for r, n in zip(notify, counts, strict=True)]
        transfer.parts, transfer.started, transfer.num_bytes, transfer.num_descriptors = [], time.monotonic(), 0, 0
        if not transfer.way.notifies_done:  # the prefill rank ends its hold itself: nobody to notify
            transfer.notify = []
        try:
            planned, release = self.moves.plan(transfer, reads, notify, self.rank, self.peers.peers)
            if release:  # prefill ranks this load takes nothing from (a stream's: its stream has no destination)
                release_failed(self.background, spec.remote, release, self.rank.name, self._secret,
                               self.config.handshake_timeout_s)
            if not planned:
                self.endings.to(transfer, TransferState.STAGING)
                self._staging_wait.append(transfer)
                return
        except (PlanError, StagingFull) as exc:
            release_unposted(transfer, self.stager)
            if isinstance(exc, PlanError):
                self.endings.fail(transfer, FailureKind.BAD_BLOCK_IDS, f"bad block ids: {exc}")
            else:
                self.endings.fail(transfer, FailureKind.STAGING, str(exc))
            return
        if not transfer.parts:  # nothing to load (or a notify-only pull)
            self.notifier.add(transfer)
            self.endings.to(transfer, TransferState.DONE)
            return
        self.endings.to(transfer, TransferState.READING)
        if (failed := self.moves.start(transfer)) is not None:
            read, exc = failed
            self.drain.abandon(transfer)
            self.peers.drop(read.peer_id)
            self._retry_or_fail(transfer, _kind(exc), f"pull from {read.peer.agent_name} could not start: {exc}")
            return
        transfer.marks["posted"] = time.time()

    def _collect_pushes(self) -> None:
        """Push replies (a refusal fails the pull as the fence would) and WRITE notifications."""
        for read, kind, why, retry in self.pushes.collect(time.monotonic(), self.config.handshake_timeout_s):
            self._contained(read.transfer, "failing a pushed pull", self._part_failed, read, kind, why, retry=retry,
                            drop_peer=retry)

    def _part_failed(self, read: Part, kind: FailureKind, why: str, *, retry: bool, drop_peer: bool) -> None:
        """One part failed: every part of its pull stops; with ``retry`` the pull is retried after a new
        handshake with that rank (it may have restarted; its peer dropped first with ``drop_peer``), else
        (or on its second failure) it fails."""
        self.drain.abandon(read.transfer)
        if not retry:
            self.endings.fail(read.transfer, kind, why)
            return
        if drop_peer:
            self.peers.drop(read.peer_id, only=read.peer)
        self._retry_or_fail(read.transfer, kind, why)

    def _poll_reads(self) -> None:
        now = time.monotonic()
        for transfer in self.in_state(TransferState.READING):
            self._contained(transfer, "polling the READs", self._poll_pull, transfer, now)
        self.stager.poll_releases()

    def _poll_pull(self, transfer: Transfer, now: float) -> None:
        for read in transfer.parts:
            if transfer.state is not TransferState.READING or read.attempt != transfer.attempt:
                break  # abandoned (or retried) during this loop
            if read.in_flight and (read.stage is None or not self.progress.on_thread()):
                self._poll(transfer, read, now)  # a staged READ's fixup runs at the engine step
        if transfer.state is TransferState.READING and all(r.done for r in transfer.parts):
            transfer.marks["read"] = time.time()
            self.endings.to(transfer, TransferState.FENCING)
            self.confirmations.if_done(transfer)

    def _poll(self, transfer: Transfer, read: Part, now: float) -> None:
        """Poll one READ; still in flight past ``transfer_timeout_s``, :meth:`_expire` gives it up."""
        event, exc = self.moves.poll(read, now)
        if event is ReadEvent.FAILED:  # a way not retried (a stream: its id serves once, only its prefill had it)
            self._part_failed(read, _kind(exc), str(exc), retry=transfer.way.retried,
                              drop_peer=not self.moves.mover_of(read).keeps_peer_on_failure)
        elif event is ReadEvent.FIXUP_FAILED:
            self.drain.abandon(transfer)
            self.endings.fail(transfer, FailureKind.FIXUP, f"fixup after the READ failed: {exc!r}")

    def _collect_fence(self) -> None:
        for read, verdict, answer in self.fence.verdicts(time.monotonic(), self.config.handshake_timeout_s):
            self._contained(read.transfer, "acting on a fence answer", self.confirmations.judged, read, verdict,
                            answer)

    # ---- endings ----------------------------------------------------------------
    def _retry_or_fail(self, transfer: Transfer, kind: FailureKind, why: str) -> None:
        """After a peer failure: re-handshake (the prefill may have restarted) and retry once per pull."""
        if transfer.attempt > 1:
            self.endings.fail(transfer, kind, why)
            return
        logger.warning("p2pkv: %s; re-handshaking and retrying request %s once", why, transfer.request_id)
        self._begin(transfer)

    def _expire(self) -> None:
        """Fail every pull past its state's deadline (``timeout``)."""
        now = time.monotonic()
        for transfer in list(self.transfers):
            if not transfer.finished and (why := self.deadlines.overdue(transfer, now)) is not None:
                self.drain.abandon(transfer)
                self.endings.fail(transfer, FailureKind.TIMEOUT, why)

    # ---- peers ------------------------------------------------------------------------
    def _busy_peers(self) -> set[PeerId]:
        """Peers a pull under way, a cancelled READ or a notification still needs (never dropped)."""
        return {pid for p in self.transfers for pid in p.peers} | self.drain.peers() | self.notifier.needed_peers()


def _declines(spec: LoadSpec) -> bool:
    """A load that takes nothing (its prompt is in this engine's prefix cache, or the request ended before its
    blocks were allocated) of a way whose prefill ranks wait for no "done" (a stream: it ends its hold itself):
    they are told at once, by a release of the load's id, so that they stop and free the hold instead of waiting
    for the lease."""
    return not way_of(spec).notifies_done and not spec.local_block_ids and not spec.report


def _needs(spec: LoadSpec, rank: LocalRank, peers: PeerTable) -> tuple[list[RankRead], list[int], list[PeerId]] | str:
    """The prefill ranks a pull of ``spec`` reads (with head slices) and notifies, and the peers they are; or
    why it is refused before anyone is contacted (:func:`_refusal`, TP sizes that cannot pair, a ``tp_size``
    other than the one the prefill engine told at its handshake)."""
    if (why := _refusal(spec, rank.engine_id)) is not None:
        return why
    try:
        reads, notify = rank.topology(spec.remote.tp_size, spec.remote.pp_size)
    except PairRefused as exc:
        return f"refused: {exc}"
    ids = sorted(PeerId.of(spec.remote, r) for r in {r.remote_rank for r in reads} | set(notify))
    known = next((peers.peers[pid].info for pid in ids if pid in peers.peers), None)
    if known is not None and (known.tp_size, known.pp_size) != (spec.remote.tp_size, spec.remote.pp_size):
        return (f"kv_transfer_params.tp_size={spec.remote.tp_size} and pp_size={spec.remote.pp_size}, but prefill "
                f"engine {known.engine_id!r} runs tp_size={known.tp_size} and pp_size={known.pp_size}")
    return reads, notify, ids


def _refusal(spec: LoadSpec, engine_id: str) -> str | None:
    """Why ``spec`` is refused before anyone is contacted, or None: params naming this engine itself.

    (Ids and hosts are ASCII: :func:`p2pkv.params.parse_remote_prefill` accepts only
    :data:`~p2pkv.params.ID_PATTERN` / :data:`~p2pkv.params.HOST_PATTERN`.)
    """
    if spec.remote.engine_id == engine_id:
        return (f"refused: kv_transfer_params.remote_engine_id={spec.remote.engine_id!r} is this engine: the "
                "request was prefilled here; send its prefill leg to another engine (a proxy's --prefill and "
                "--decode must differ)")
    return None


def _kind(exc: BaseException) -> FailureKind:
    """``DISCONNECT`` when NIXL said the peer went away, else ``TRANSFER``."""
    return FailureKind.DISCONNECT if isinstance(exc, TransferError) and exc.disconnected else FailureKind.TRANSFER


def agent_in_use(agent_name: str, drain: Drain, transfers: list[Transfer]) -> bool:
    """Whether prefill agent ``agent_name`` may still WRITE into a part (a push or stream in flight, or any part
    draining): its NIXL agent then stays loaded when its peer is dropped, since only a loaded agent can be asked
    whether it is gone. (A READ in flight does not keep it: it fails with the connection, and a dropped peer is
    connected afresh.)"""
    return drain.uses(agent_name) or any(
        part.in_flight and part.direction is not None and part.direction.way.prefill_writes
        and part.peer.agent_name == agent_name
        for transfer in transfers for part in transfer.parts)
