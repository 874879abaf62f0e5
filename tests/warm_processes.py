"""Spawned processes with their imports done, reused by the tests that run prefill ranks in a process of
their own (:class:`tests.p2p_harness.PrefillProc`).

A spawned process spends seconds importing torch, NIXL and p2pkv before it
runs a line of the test; a :class:`WarmProcess` has done that once and runs
one job after another. A job is a module-level function called as
``target(*args, channels)``; it talks to the test through
:class:`Channels` and must leave nothing running when it returns (agents
closed, threads joined). A job that raises ends its process, and a process
the test killed is never reused: :func:`take` then starts a fresh one.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Channels", "WarmProcess", "give_back", "others", "take"]

WARM_IMPORTS = ("torch", "numpy", "p2pkv.worker", "tests.workers")
"""Modules a warm process imports before its first job."""

IDLE_S = 300.0
"""A warm process with no job for this long (seconds) exits."""


@dataclass(frozen=True)
class Channels:
    """A job's links to the test: ``inbox`` (test → job), ``outbox`` (job → test), ``stop`` (set by the test)."""

    inbox: Any
    outbox: Any
    stop: Any


class WarmProcess:
    """One spawned process serving jobs, one at a time, over its :class:`Channels`."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.channels = Channels(ctx.Queue(), ctx.Queue(), ctx.Event())
        self.process = ctx.Process(target=_serve, args=(self.channels,), daemon=True)
        self.process.start()

    def run(self, target: Callable[..., None], *args: object) -> Channels:
        """Start ``target(*args, channels)`` in the process (after its imports, if it is still importing)."""
        self.channels.stop.clear()
        self.channels.inbox.put(("job", target, args))
        return self.channels

    def finished(self, timeout_s: float = 20.0) -> bool:
        """Wait until the current job has returned (what it sent meanwhile is dropped): True if the process is
        free for another job, False if it is dead or still busy."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.process.is_alive():
            try:
                msg = self.channels.outbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if msg == ("job returned",):
                return True
        return False

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        self.process.kill()
        self.process.join(timeout=20)


_IDLE: list[WarmProcess] = []


def take() -> WarmProcess:
    """A warm process with no job: an idle one, else a new one (its imports still running)."""
    while _IDLE:
        proc = _IDLE.pop()
        if proc.process.is_alive():
            return proc
    return WarmProcess()


def others() -> list[mp.process.BaseProcess]:
    """This process's live children but the idle warm processes (kept for the next :func:`take`): what a test
    that must leave no child behind checks."""
    idle = {p.process.pid for p in _IDLE}
    return [c for c in mp.active_children() if c.pid not in idle]


def give_back(proc: WarmProcess, kill: bool = False) -> bool:
    """Return ``proc`` once its job has returned, or kill it if it does not (or died, or ``kill``); keep one
    spare either way, so the next :func:`take` does not wait for imports. True if the job had returned."""
    returned = not kill and proc.process.is_alive() and proc.finished()
    if returned:
        _IDLE.append(proc)
    else:
        proc.kill()
    if not _IDLE:
        _IDLE.append(WarmProcess())
    return returned


def _serve(channels: Channels) -> None:
    parent = os.getppid()
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    idle_since = time.monotonic()
    while os.getppid() == parent and time.monotonic() - idle_since < IDLE_S:
        try:
            msg = channels.inbox.get(timeout=0.5)
        except queue.Empty:
            continue
        if msg[0] != "job":
            continue  # a command sent to a job that has returned
        _, target, args = msg
        target(*args, channels)  # an exception ends the process: never reused
        channels.outbox.put(("job returned",))
        idle_since = time.monotonic()
