"""A prefill worker in its own process that can be told what to lease, and a decode pump.

Shared by ``tests/test_faults.py`` and ``tests/test_churn.py``. The prefill
process runs a real :class:`p2pkv.worker.WorkerSide` with a synthetic
``BLHNC`` KV cache (random values from ``seed``) and a real NIXL agent. The
test process sends it commands (``lease``, ``stop``) and reads back every
``finished_sending`` set it produces, split into requests released by a
completion notification and requests whose lease expired, so the test can
check that each leased request is released exactly once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass, field

import torch

from p2pkv.metadata import P2pKvMetadata, PullSpec
from p2pkv.params import RemotePrefill
from p2pkv.tools.bench.synth import make_kv_caches
from p2pkv.worker import WorkerSide
from tests.workers import free_port, make_worker, model_info

__all__ = ["ENGINE", "LAYOUT", "DecodeSide", "PrefillProc", "free_port", "notify_task", "pull_task"]

ENGINE = "prefill-engine"
LAYOUT = "BLHNC"  # one contiguous run of bytes per block: cheap exact comparisons
MAX_LIFE_S = 170.0  # a prefill process never outlives this, whatever the test does


def shape(num_blocks: int) -> dict[str, int]:
    return dict(num_layers=4, num_blocks=num_blocks, num_heads=2, block_size=32, head_dim=16)


def _prefill_main(port: int, seed: int, num_blocks: int, leases: dict[str, float], lease_s: float,
                  cmds: mp.Queue, out: mp.Queue) -> None:
    parent = os.getppid()
    _, views = make_kv_caches(LAYOUT, seed=seed, **shape(num_blocks))
    worker = make_worker(ENGINE, port, lease_s=lease_s)
    worker.model = model_info(LAYOUT)
    worker.register_kv_caches(views, num_blocks)
    expired_now: list[str] = []
    pop_expired = worker.holds.leases.pop_expired

    def recording_pop_expired() -> list[str]:
        got = pop_expired()
        expired_now.extend(got)
        return got

    worker.holds.leases.pop_expired = recording_pop_expired  # type: ignore[method-assign]
    now = time.monotonic()
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
            worker.start_load_kv(P2pKvMetadata(send_leases={r: now + seconds for r in ids}))
            out.put(("leased", token))
        sending, _ = worker.get_finished()
        if sending:
            expired = set(expired_now)
            out.put(("released", sorted(sending - expired), sorted(sending & expired)))
        expired_now.clear()
    out.put(("held", sorted(worker.holds.leases._deadline)))
    worker.shutdown()
    out.put(("bye",))


@dataclass
class PrefillProc:
    """A prefill :class:`WorkerSide` in a spawned process (see module docstring).

    Attributes:
        port: side-channel port (the same after a restart).
        seed: seed of the cache values (block ``b`` holds ``expected(seed)[b]``).
        notified, expired: request id → times released that way (all incarnations).
        leased: every request id leased so far.
    """

    port: int
    seed: int = 1
    num_blocks: int = 64
    lease_s: float = 30.0
    notified: dict[str, int] = field(default_factory=dict)
    expired: dict[str, int] = field(default_factory=dict)
    leased: set[str] = field(default_factory=set)
    held_at_stop: list[str] | None = None
    released_by_incarnation: list[set[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ctx = mp.get_context("spawn")
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
        self._cmds, self._out = self._ctx.Queue(), self._ctx.Queue()
        leases = dict(leases or {})
        self.leased |= set(leases)
        self.released_by_incarnation.append(set())
        self._proc = self._ctx.Process(
            target=_prefill_main, daemon=True,
            args=(self.port, self.seed, self.num_blocks, leases, self.lease_s, self._cmds, self._out))
        self._proc.start()
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
            self._expected[seed], _ = make_kv_caches(LAYOUT, seed=seed, **shape(self.num_blocks))
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
            _, notified, expired = msg
            for rid in notified:
                self.notified[rid] = self.notified.get(rid, 0) + 1
            for rid in expired:
                self.expired[rid] = self.expired.get(rid, 0) + 1
            self.released_by_incarnation[-1].update(notified, expired)
        elif msg[0] == "held":
            self.held_at_stop = list(msg[1])
        return msg

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

    def kill(self) -> None:
        """SIGKILL the current incarnation (events it had not queued yet are lost)."""
        assert self._proc is not None
        self.drain(0.05)
        self._proc.kill()
        self._proc.join(timeout=20)

    def stop(self) -> list[str]:
        """Stop the current incarnation cleanly; returns the request ids it still held."""
        if self._proc is None:
            return []
        if self._proc.is_alive():
            self._cmds.put(("stop",))
            end = time.monotonic() + 30
            while time.monotonic() < end:
                msg = self._next(timeout=end - time.monotonic())
                if msg is not None and msg[0] == "bye":
                    break
        self._proc.join(timeout=20)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        code = self._proc.exitcode
        self._proc = None
        assert code == 0, f"prefill process exited with {code}"
        return list(self.held_at_stop or [])


def pull_task(request_id: str, remote_request: str, port: int, local: list[int], remote: list[int],
              engine: str = ENGINE) -> PullSpec:
    rp = RemotePrefill(engine, remote_request, "127.0.0.1", port, tuple(remote), 1)
    return PullSpec(request_id, tuple(local), tuple(remote), rp)


def notify_task(request_id: str, remote_request: str, port: int, engine: str = ENGINE) -> PullSpec:
    """What the scheduler sends for an aborted request: notify the prefill side, load nothing."""
    rp = RemotePrefill(engine, remote_request, "127.0.0.1", port, (), 1)
    return PullSpec(request_id, (), (), rp, report=False)


class DecodeSide:
    """A decode :class:`WorkerSide` in this process with a zeroed ``BLHNC`` cache."""

    def __init__(self, num_blocks: int = 64, **cfg) -> None:
        self.num_blocks = num_blocks
        self.base, views = make_kv_caches(LAYOUT, fill=0.0, **shape(num_blocks))
        self.worker: WorkerSide = make_worker("decode-engine", free_port(), **cfg)
        self.worker.model = model_info(LAYOUT)
        self.worker.register_kv_caches(views, num_blocks)
        self.finished: dict[str, int] = {}
        self.errors: set[int] = set()

    def start(self, *tasks: PullSpec) -> None:
        self.worker.start_load_kv(P2pKvMetadata(pulls=list(tasks)))

    def step(self) -> set[str]:
        """One ``get_finished`` + ``get_block_ids_with_load_errors`` (what vLLM calls each step)."""
        _, recving = self.worker.get_finished()
        for rid in recving:
            self.finished[rid] = self.finished.get(rid, 0) + 1
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
