"""Run one engine in the foreground: start, wait for health, forward signals, report its death."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from p2pkv.tools.deploy.processes import Child, LaunchError, start_child, stop_children, wait_healthy


class Stopped(Exception):
    """SIGTERM or SIGINT arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """SIGTERM/SIGINT → :class:`Stopped`, except inside :meth:`deferred`, where they wait."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self.defer = False
        self.saved: dict[int, object] = {}

    def _handle(self, signum: int, _frame: object) -> None:
        if self.defer:
            self.pending = self.pending or signum
        else:
            raise Stopped(signum)

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.saved[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.defer = True
        try:
            yield
        finally:
            self.defer = False
        if self.pending is not None:
            raise Stopped(self.pending)


class _Echo(threading.Thread):
    """Copies a growing log file to a stream until stopped (then drains what is left)."""

    def __init__(self, path: Path, out: TextIO) -> None:
        super().__init__(name=f"echo-{path.name}", daemon=True)
        self.path, self.out, self.done = path, out, threading.Event()

    def run(self) -> None:
        with contextlib.suppress(OSError), open(self.path, "rb") as log:
            while True:
                finished = self.done.is_set()
                data = log.read()
                if data:
                    self.out.write(data.decode(errors="replace"))
                    self.out.flush()
                elif finished:
                    return
                else:
                    self.done.wait(0.3)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5.0)


def supervise(name: str, argv: list[str], env: dict[str, str], log_dir: Path, health_url: str,
              ready_timeout_s: float, on_ready: Callable[[Child], None] | None = None,
              echo: TextIO | None = None, poll_s: float = 0.5) -> int:
    """Start ``argv`` as ``name``, wait for ``health_url``, then keep it running.

    SIGTERM and SIGINT stop the child's process group (SIGTERM, then
    SIGKILL after a grace period) and return 0. Must run in the main thread.

    Args:
        name: label; the log goes to ``log_dir/<name>.log``.
        argv / env: the command and its full environment.
        health_url: polled until it answers 200.
        ready_timeout_s: seconds to wait for health.
        on_ready: called once healthy (after ``ready`` is printed).
        echo: copy the child's log to this stream as it grows (None: don't).
        poll_s: seconds between liveness checks.

    Returns:
        0 after a signal stopped the child; 1 when the child exited or never
        became healthy (a message with the end of its log goes to stderr).
    """
    signals = _Signals()
    signals.install()
    child: Child | None = None
    follower: _Echo | None = None
    try:
        with signals.deferred():
            child = start_child(name, argv, env, log_dir, health_url)
            print(f"{name}: pid {child.proc.pid} (process group {child.proc.pid}), log {child.log_path}",
                  flush=True)
            if echo is not None:
                follower = _Echo(child.log_path, echo)
                follower.start()
        wait_healthy([child], ready_timeout_s)
        print(f"ready: {name} answers {health_url}", flush=True)
        if on_ready is not None:
            on_ready(child)
        while child.proc.poll() is None:
            time.sleep(poll_s)
        raise LaunchError(f"{name} exited with code {child.proc.returncode}; log {child.log_path}:\n{child.tail()}")
    except LaunchError as exc:
        signals.defer = True
        _report(follower, f"p2pkv launch {name}: {exc}")
        return 1
    except Stopped as stop:
        signals.defer = True
        print(f"{name}: got {stop}, stopping the engine", flush=True)
        return 0
    finally:
        signals.defer = True
        if child is not None:
            stop_children([child])
        if follower is not None:
            follower.stop()
        signals.restore()


def _report(follower: _Echo | None, message: str) -> None:
    if follower is not None:
        follower.stop()
    print(message, file=sys.stderr, flush=True)
