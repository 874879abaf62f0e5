"""A prefill worker in its own process that can be told what to lease, and a decode pump.

The one way the tests run prefill ranks in a process of their own (``tests/fault_injection/``, the ``prefill``
fixture of ``tests/conftest.py``, ``tests/test_churn.py``, ``tests/test_transfer.py``, ``tests/test_hetero.py``,
...), in the reused processes of :mod:`tests.warm_processes`. The prefill process runs a real
:class:`p2pkv.worker.WorkerSide` with a synthetic KV cache (``BLHNC`` unless told otherwise; random values from
``seed``) and a real NIXL agent, or the ranks it is given (:data:`Ranks`: ``tests/test_hetero.py``'s TP ranks with
position-coded caches). The test process sends it
commands (``lease``, ``stop``, and :meth:`PrefillProc.call`: faults injected
into its NIXL agent, its pusher held back, its side channel slowed, its
state read) and reads back every ``finished_sending`` set it produces, split
into requests released by expiry and the others (a "done" or a release), each
with its time, so the test can check that each leased request is released
exactly once. In push mode it also reports every pin and unpin of a hold (a
WRITE queued, then ended), with its time on the host's monotonic clock, so a
test can check that a decode worker gave blocks back only after the WRITE
into them ended.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import torch

from p2pkv.decode import progress as pull_progress
from p2pkv.metadata import LoadSpec, P2pKvMetadata, StreamChunk
from p2pkv.params import RemotePrefill
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.pusher import Pusher
from p2pkv.telemetry.hold_spans import HoldEnd
from p2pkv.testing import make_kv_caches
from p2pkv.worker import WorkerSide
from tests import warm_processes
from tests.faults import FaultyNixlAgent
from tests.warm_processes import Channels, WarmProcess
from tests.workers import free_port, make_worker, model_info

__all__ = [
    "DECODE_CFG", "ENGINE", "LAYOUT", "DecodeSide", "PrefillProc", "Ranks", "free_port", "notify_task", "pull_task",
    "synthetic_rank", "writes_left",
]

ENGINE = "prefill-engine"
LAYOUT = "BLHNC"  # one contiguous run of bytes per block: cheap exact comparisons
MAX_LIFE_S = 170.0  # a prefill process never outlives this, whatever the test does
DECODE_CFG = dict(handshake_timeout_s=2.0, handshake_attempts=1, transfer_timeout_s=10.0, pull_thread=False)
"""A :class:`DecodeSide`'s settings in the ``decode`` fixtures (``tests/conftest.py``): faults are injected per
call, so only the test steps the pulls (no pulls' thread)."""


def writes_left(pusher: Pusher) -> int:
    """WRITEs a prefill rank's pusher has queued or in flight."""
    return pusher.writes_left()


def shape(num_blocks: int) -> dict[str, int]:
    return dict(num_layers=4, num_blocks=num_blocks, num_heads=2, block_size=32, head_dim=16)


Ranks = Callable[[int], list[tuple[WorkerSide, object]]]
"""What a prefill process runs: ``ranks(port)`` makes its prefill ranks (rank ``r``'s side channel on ``port + r``),
registered, each with what must live as long as it (its KV cache); a module-level function or a
``functools.partial`` of one (it is sent to the process)."""


def synthetic_rank(seed: int, num_blocks: int, layout: str, lease_s: float,
                   port: int, **cfg: object) -> list[tuple[WorkerSide, object]]:
    """One prefill rank of :data:`ENGINE` with a synthetic ``layout`` cache of ``num_blocks`` (random values from
    ``seed``) and settings ``cfg`` (``secret``: a secured rank, which streams): :class:`PrefillProc`'s ranks
    unless it is given others."""
    _, views = make_kv_caches(layout, seed=seed, **shape(num_blocks))
    worker = make_worker(ENGINE, port, layout, lease_s=lease_s, **cfg)
    worker.register_kv_caches(views, num_blocks)
    return [(worker, views)]


def _prefill_main(ranks: Ranks, port: int, leases: dict[str, float], channels: Channels) -> None:
    cmds, out = channels.inbox, channels.outbox
    parent = os.getppid()
    built = ranks(port)  # the caches in it live until the process ends
    workers = [worker for worker, _ in built]
    control = _Control(workers[0], out)
    ends = [control._ends, *(_recording_ends(w.holds) for w in workers[1:])]
    now = time.monotonic()
    for worker in workers:
        worker.start_load_kv(P2pKvMetadata(send_leases={r: now + s for r, s in leases.items()}))
    out.put(("ready", os.getpid()))
    end = time.monotonic() + MAX_LIFE_S
    while time.monotonic() < end and os.getppid() == parent:
        try:
            cmd = cmds.get(timeout=0.002)
        except queue.Empty:
            cmd = None
        if cmd is not None and cmd[0] == "stop":
            break
        if cmd is not None and cmd[0] == "lease":
            _, ids, seconds, token = cmd
            now = time.monotonic()
            for worker in workers:
                worker.start_load_kv(P2pKvMetadata(send_leases={r: now + seconds for r in ids}))
            out.put(("leased", token))
        if cmd is not None and cmd[0] == "call":
            _, token, name, args = cmd
            out.put(("result", token, getattr(control, name)(*args)))
        for rank, worker in enumerate(workers):
            sending, _ = worker.get_finished()
            if sending:
                ended = dict(ends[rank])
                ends[rank].clear()
                expired = {r for r in sending if ended.get(r) is HoldEnd.EXPIRED}
                out.put(("released", rank, sorted(sending - expired), sorted(expired), time.monotonic()))
    pins: collections.Counter[str] = collections.Counter()
    for worker in workers:
        pins.update(worker.holds._pins)
    out.put(("held", sorted({r for w in workers for r in w.holds.leases._deadline}),
             sorted({r for w in workers for r in w.holds._deferred}), dict(pins)))
    for worker in workers:
        worker.shutdown()
    out.put(("bye",))


def _recording_ends(holds: PrefillHolds) -> dict[str, HoldEnd]:
    """Record why each hold of ``holds`` ends (request id → :class:`HoldEnd`) in the dict returned."""
    ends: dict[str, HoldEnd] = {}
    end_holds = holds._end

    def recording_end(ending: dict[str, HoldEnd], now: float) -> dict[str, HoldEnd]:
        ended = end_holds(ending, now)
        ends.update(ended)
        return ended

    holds._end = recording_end  # type: ignore[method-assign]
    return ends


class _Control:
    """What the test process may do to a prefill worker, rank 0 (``PrefillProc.call``), and the events it reports.

    Every pin and unpin of a hold (push mode: a WRITE queued, then ended) is sent to the test process with
    its ``time.monotonic()`` (one clock for every process of the host), and why each hold ended is kept for
    the ``released`` event.
    """

    def __init__(self, worker: WorkerSide, out: mp.Queue) -> None:
        self.worker, self.out = worker, out
        self._faults: list[FaultyNixlAgent] = []
        self._stall_until = 0.0
        self._push_delay_s = 0.0
        self._next_push_delays: list[float] = []
        holds, pusher, server = worker.holds, worker.pusher, worker.server
        assert pusher is not None and server is not None
        self._ends = _recording_ends(holds)
        pin, unpin = holds.pin, holds.unpin
        post, on_push = pusher._post_in_turn, server._dispatch._on_push

        def recording_pin(request_id: str, block_ids: list[int]) -> str:
            answer = pin(request_id, block_ids)
            out.put(("pin", request_id, answer, time.monotonic()))
            return answer

        def recording_unpin(request_id: str) -> None:
            unpin(request_id)
            out.put(("unpin", request_id, time.monotonic()))

        def stalled_post(now: float) -> None:
            if time.monotonic() >= self._stall_until:
                post(now)

        def delayed_on_push(msg: object) -> tuple[str, str]:
            delay = self._next_push_delays.pop(0) if self._next_push_delays else self._push_delay_s
            if delay:
                time.sleep(delay)
            return on_push(msg)  # type: ignore[misc]

        holds.pin, holds.unpin = recording_pin, recording_unpin  # type: ignore[method-assign]
        pusher._post_in_turn = stalled_post  # type: ignore[method-assign]
        server._dispatch._on_push = self._on_push = delayed_on_push  # type: ignore[assignment]

    def inject(self, *faults: tuple[str, int, str, int | None]) -> None:
        """Wrap the NIXL agent in one :class:`tests.faults.FaultyNixlAgent` per ``(method, n, mode, times)``."""
        self.restore()
        agent = self.worker.agent
        assert agent is not None
        for method, n, mode, times in faults:
            agent._agent = FaultyNixlAgent(agent._agent, method, n, mode=mode, times=times)  # type: ignore[arg-type]
            self._faults.append(agent._agent)

    def restore(self) -> dict[str, int]:
        """Unwrap the injected faults; how many fired, and the calls of each wrapped method (outermost)."""
        agent = self.worker.agent
        assert agent is not None
        fired = {"faults": sum(f.faults for f in self._faults)}
        if self._faults:
            fired.update(self._faults[-1].calls)
            agent._agent = self._faults[0].real
        self._faults = []
        return fired

    def stall_pusher(self, seconds: float) -> None:
        """Post no WRITE for ``seconds`` from now (requests are still accepted and queued); 0: post again."""
        self._stall_until = time.monotonic() + seconds
        self.worker.writes.wake()  # type: ignore[union-attr]

    def delay_push(self, seconds: float) -> None:
        """Hold the side-channel thread ``seconds`` before it handles each push request (a busy prefill)."""
        self._push_delay_s = seconds

    def delay_next_push(self, seconds: float) -> None:
        """Hold the side-channel thread ``seconds`` before it handles the next push request only (one stall)."""
        self._next_push_delays.append(seconds)

    def take_pushes(self, on: bool) -> None:
        """False: the side channel refuses push requests, as one without push support does; True: serves them."""
        self.worker.server._dispatch._on_push = self._on_push if on else None  # type: ignore[union-attr]

    def stream(self, chunks: list[StreamChunk], layer_names: list[str], end_step: bool = False,
               aborts: dict[str, str] | None = None, restarts: list[str] | None = None) -> None:
        """A step of layer-streamed prefills: ``chunks`` open (or go on with) their streams, ``aborts`` (prefill
        request id → why) stop theirs, ``restarts`` (prefill request ids) were preempted, ``layer_names`` are
        reported done (``save_kv_layer``), and with ``end_step`` the step's forward ends (``wait_for_save``)."""
        meta = P2pKvMetadata(streams=list(chunks), stream_aborts=dict(aborts or {}),
                             stream_restarts=list(restarts or []))
        self.worker.start_load_kv(meta)
        for name in layer_names:
            self.worker.save_kv_layer(name, meta)
        if end_step:
            self.worker.wait_for_save()

    def state(self) -> dict:
        """The pusher's counters and queue, and the holds' leases, pins and deferred endings."""
        pusher, holds = self.worker.pusher, self.worker.holds
        assert pusher is not None
        return {"counters": dataclasses.asdict(pusher.counters), "pending": writes_left(pusher),
                "held": sorted(holds.leases._deadline), "pins": dict(holds._pins), "deferred": sorted(holds._deferred)}


@dataclass
class PrefillProc:
    """A prefill :class:`WorkerSide` in a spawned process (see module docstring).

    Attributes:
        port: side-channel port (the same after a restart).
        seed: seed of the cache values (block ``b`` holds ``expected(seed)[b]``).
        num_blocks, lease_s: the cache's blocks; the leases' default seconds.
        layout: the cache's layout (:func:`p2pkv.testing.make_kv_caches`; ``expected`` and :class:`DecodeSide`
            compare blocks as ``BLHNC`` ones).
        settings: more :class:`~p2pkv.config.P2pKvConfig` settings of :func:`synthetic_rank` (``secret``: a
            secured rank, which can stream).
        ranks: the prefill ranks to run instead of :func:`synthetic_rank` of the fields above (:data:`Ranks`:
            several ranks, other caches); leases and the released events are every rank's, the control
            (:meth:`call`) rank 0's.
        released_by_rank: rank → the request ids it released, in order (all incarnations).
        notified, expired: request id → times released that way (all incarnations and ranks).
        released_at: request id → ``time.monotonic()`` of each release (the host's clock, the same in every process).
        leased: every request id leased so far.
        pins: ``(request id, answer, time.monotonic())`` of every pin asked for (push mode: a WRITE to queue).
        unpins: request id → ``time.monotonic()`` of each unpin (a WRITE ended, or will never start).
        held_at_stop / deferred_at_stop / pinned_at_stop: what the incarnation stopped last still held: leases,
            endings waiting for a WRITE, pins (request id → count).
    """

    port: int
    seed: int = 1
    num_blocks: int = 64
    lease_s: float = 30.0
    layout: str = LAYOUT
    settings: dict[str, object] = field(default_factory=dict)
    ranks: Ranks | None = None
    notified: dict[str, int] = field(default_factory=dict)
    expired: dict[str, int] = field(default_factory=dict)
    released_at: dict[str, list[float]] = field(default_factory=dict)
    leased: set[str] = field(default_factory=set)
    pins: list[tuple[str, str, float]] = field(default_factory=list)
    unpins: dict[str, list[float]] = field(default_factory=dict)
    held_at_stop: list[str] | None = None
    deferred_at_stop: list[str] | None = None
    pinned_at_stop: dict[str, int] | None = None
    released_by_incarnation: list[set[str]] = field(default_factory=list)
    released_by_rank: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._warm: WarmProcess | None = None  # the warm process running the current incarnation
        self._proc: mp.process.BaseProcess | None = None
        self._token = 0
        self._ready = False
        self._expected: dict[int, torch.Tensor] = {}

    def start(self, leases: dict[str, float] | None = None, seed: int | None = None) -> None:
        """Start an incarnation holding ``leases`` (request id → seconds from now); wait until it serves."""
        self.spawn(leases, seed)
        self.wait_ready()

    def spawn(self, leases: dict[str, float] | None = None, seed: int | None = None) -> None:
        """Start an incarnation without waiting for it (see :meth:`wait_ready`)."""
        assert self._proc is None or not self._proc.is_alive()
        if seed is not None:
            self.seed = seed
        leases = dict(leases or {})
        self.leased |= set(leases)
        self.released_by_incarnation.append(set())
        self._warm = warm_processes.take()
        self._proc = self._warm.process
        ranks = self.ranks or functools.partial(synthetic_rank, self.seed, self.num_blocks, self.layout, self.lease_s,
                                                **self.settings)
        channels = self._warm.run(_prefill_main, ranks, self.port, leases)
        self._cmds, self._out = channels.inbox, channels.outbox
        self._ready = False

    def poll_ready(self) -> bool:
        """True once the incarnation serves; raises if it died."""
        assert self._proc is not None
        while not self._ready:
            try:
                msg = self._out.get_nowait()
            except queue.Empty:
                if not self._proc.is_alive():
                    raise AssertionError(f"prefill process died on start (exit code {self._proc.exitcode})") from None
                return False
            assert msg[0] == "ready", msg
            self._ready = True
        return True

    def wait_ready(self, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while not self.poll_ready():
            if time.monotonic() > end:
                assert self._proc is not None
                self._proc.kill()
                raise AssertionError(f"prefill process did not start within {timeout} s")
            time.sleep(0.05)

    def expected(self, seed: int | None = None) -> torch.Tensor:
        """The prefill cache of ``seed`` (default: the current one), ``[blocks, ...]``."""
        seed = self.seed if seed is None else seed
        if seed not in self._expected:
            self._expected[seed], _ = make_kv_caches(self.layout, seed=seed, **shape(self.num_blocks))
        return self._expected[seed]

    def lease(self, ids: list[str], seconds: float | None = None) -> None:
        """Hold ``ids`` for ``seconds`` (default ``lease_s``); returns once the process holds them."""
        self._token += 1
        self.leased |= set(ids)
        self._cmds.put(("lease", list(ids), self.lease_s if seconds is None else seconds, self._token))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = self._next(timeout=deadline - time.monotonic())
            if msg is not None and msg[0] == "leased" and msg[1] == self._token:
                return
        raise AssertionError("the prefill process did not take the leases")

    def _next(self, timeout: float) -> tuple | None:
        try:
            msg = self._out.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if msg[0] == "released":
            _, rank, notified, expired, at = msg
            self.released_by_rank.setdefault(rank, []).extend((*notified, *expired))
            for rid in notified:
                self.notified[rid] = self.notified.get(rid, 0) + 1
            for rid in expired:
                self.expired[rid] = self.expired.get(rid, 0) + 1
            for rid in (*notified, *expired):
                self.released_at.setdefault(rid, []).append(at)
            self.released_by_incarnation[-1].update(notified, expired)
        elif msg[0] == "pin":
            self.pins.append(msg[1:])
        elif msg[0] == "unpin":
            self.unpins.setdefault(msg[1], []).append(msg[2])
        elif msg[0] == "held":
            self.held_at_stop, self.deferred_at_stop, self.pinned_at_stop = list(msg[1]), list(msg[2]), dict(msg[3])
        return msg

    def call(self, name: str, *args: object, timeout: float = 30.0) -> object:
        """Run ``name(*args)`` of the incarnation's control (``inject``, ``restore``, ``stall_pusher``,
        ``delay_push``, ``delay_next_push``, ``take_pushes``, ``stream``, ``state``: see ``_Control``) between
        two of its steps; its result."""
        self._token += 1
        self._cmds.put(("call", self._token, name, args))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._next(timeout=deadline - time.monotonic())
            if msg is not None and msg[0] == "result" and msg[1] == self._token:
                return msg[2]
        raise AssertionError(f"the prefill process did not answer {name}")

    def inject(self, *faults: tuple[str, int, str, int | None]) -> None:
        """Make the incarnation's NIXL agent fail: one ``(method, n, mode, times)`` per fault (:mod:`tests.faults`)."""
        self.call("inject", *faults)

    def restore(self) -> dict[str, int]:
        """Remove the injected faults; ``{"faults": fired, method: calls...}``."""
        return self.call("restore")  # type: ignore[return-value]

    def state(self) -> dict:
        """The incarnation's pusher counters, WRITEs pending, leases held, pins and deferred endings."""
        return self.call("state")  # type: ignore[return-value]

    def unpinned(self, request_id: str, timeout: float = 10.0) -> float:
        """``time.monotonic()`` of ``request_id``'s last unpin once it has no pin left (waits up to ``timeout``).
        Events already sent are read first, so a pin sent just before is not missed."""
        self.drain(0.05)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pinned = sum(1 for rid, answer, _ in self.pins if rid == request_id and answer == "held")
            if pinned and len(self.unpins.get(request_id, [])) >= pinned:
                return self.unpins[request_id][-1]
            self._next(timeout=0.02)
        raise AssertionError(f"{request_id} is still pinned after {timeout} s")

    def drain(self, seconds: float = 0.0) -> None:
        """Read released events for ``seconds`` (at least everything already queued)."""
        end = time.monotonic() + seconds
        while True:
            msg = self._next(timeout=min(0.05, max(0.0, end - time.monotonic())))
            if msg is None and time.monotonic() >= end:
                return

    def wait_released(self, ids: set[str], timeout: float) -> bool:
        """True once every id in ``ids`` was released (either way) within ``timeout`` s."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if ids <= self.released():
                return True
            self._next(timeout=0.05)
        return ids <= self.released()

    def released(self) -> set[str]:
        return set(self.notified) | set(self.expired)

    def times_released(self, rid: str) -> int:
        return self.notified.get(rid, 0) + self.expired.get(rid, 0)

    def unreleased(self) -> set[str]:
        return self.leased - self.released()

    def alive(self) -> bool:
        """True while the current incarnation's process runs."""
        return self._proc is not None and self._proc.is_alive()

    def kill(self) -> None:
        """SIGKILL the current incarnation (events it had not queued yet are lost)."""
        assert self._proc is not None and self._warm is not None
        self.drain(0.05)
        warm_processes.give_back(self._warm, kill=True)

    def stop(self) -> list[str]:
        """Stop the current incarnation cleanly; returns the request ids it still held (leases, and endings
        waiting for a WRITE)."""
        if self._proc is None:
            return []
        said_bye = False
        if self._proc.is_alive():
            self._cmds.put(("stop",))
            end = time.monotonic() + 30
            while time.monotonic() < end and not said_bye:
                msg = self._next(timeout=end - time.monotonic())
                said_bye = msg is not None and msg[0] == "bye"
        assert self._warm is not None
        self._proc = None
        returned = warm_processes.give_back(self._warm) and said_bye
        assert returned, f"the prefill incarnation did not stop cleanly (exit code {self._warm.process.exitcode})"
        return sorted({*(self.held_at_stop or []), *(self.deferred_at_stop or [])})


def pull_task(request_id: str, remote_request: str, port: int, local: list[int], remote: list[int],
              engine: str = ENGINE) -> LoadSpec:
    rp = RemotePrefill(engine, remote_request, "127.0.0.1", port, tuple(remote), 1)
    return LoadSpec(request_id, tuple(local), tuple(remote), rp)


def notify_task(request_id: str, remote_request: str, port: int, engine: str = ENGINE) -> LoadSpec:
    """What the scheduler sends for an aborted request: notify the prefill side, load nothing."""
    rp = RemotePrefill(engine, remote_request, "127.0.0.1", port, (), 1)
    return LoadSpec(request_id, (), (), rp, report=False)


class DecodeSide:
    """A decode :class:`WorkerSide` in this process with a zeroed ``BLHNC`` cache, set up with p2pkv settings
    ``cfg``; without ``pull_thread`` its pulls advance only when the test steps it (no pulls' thread:
    :data:`p2pkv.decode.progress.INTERVAL_S` 0 while its receiver is made)."""

    def __init__(self, num_blocks: int = 64, *, pull_thread: bool = True, **cfg) -> None:
        self.num_blocks = num_blocks
        self.base, views = make_kv_caches(LAYOUT, fill=0.0, **shape(num_blocks))
        self.worker: WorkerSide = make_worker("decode-engine", free_port(), **cfg)
        self.worker.model = model_info(LAYOUT)
        interval_s = pull_progress.INTERVAL_S if pull_thread else 0.0
        with mock.patch.object(pull_progress, "INTERVAL_S", interval_s):
            self.worker.register_kv_caches(views, num_blocks)
        self.finished: dict[str, int] = {}
        self.finished_at: dict[str, float] = {}  # request id → time.monotonic() it was first reported
        self.errors: set[int] = set()

    def start(self, *tasks: LoadSpec) -> None:
        self.worker.start_load_kv(P2pKvMetadata(loads=list(tasks)))

    def step(self) -> set[str]:
        """One ``get_finished`` + ``get_block_ids_with_load_errors`` (what vLLM calls each step)."""
        _, recving = self.worker.get_finished()
        for rid in recving:
            self.finished[rid] = self.finished.get(rid, 0) + 1
            self.finished_at.setdefault(rid, time.monotonic())
        self.errors |= self.worker.get_block_ids_with_load_errors()
        return recving

    def pump(self, want: set[str], timeout: float) -> set[str]:
        """Step until every id in ``want`` finished receiving or ``timeout`` s passed; the ones missing."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.step()
            if want <= set(self.finished):
                return set()
            time.sleep(0.002)
        return want - set(self.finished)

    def take_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def block_ok(self, local: int, remote: int, expected: torch.Tensor) -> bool:
        return torch.equal(self.base[local], expected[remote])

    def close(self) -> None:
        self.worker.shutdown()
