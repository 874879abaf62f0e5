"""Child processes with health waits and clean stops."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


class LaunchError(RuntimeError):
    """A child process died or never became healthy; the message says which and where its log is."""


@dataclass
class Child:
    """A started process with its log file."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    health_url: str

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the child's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_child(name: str, argv: list[str], env: dict[str, str], log_dir: Path, health_url: str) -> Child:
    """Start ``argv`` in its own process group with output to ``log_dir/name.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    return Child(name, proc, log_path, health_url)


def wait_healthy(children: list[Child], timeout_s: float, poll_s: float = 1.0) -> None:
    """Wait until every child's health URL answers 200.

    Raises:
        LaunchError: a child exited, or ``timeout_s`` seconds passed; the
            message names the child and shows the end of its log.
    """
    deadline = time.monotonic() + timeout_s
    waiting = list(children)
    with httpx.Client(timeout=2.0) as client:
        while waiting:
            for child in list(waiting):
                if child.proc.poll() is not None:
                    raise LaunchError(
                        f"{child.name} exited with code {child.proc.returncode} before it was "
                        f"healthy; log {child.log_path}:\n{child.tail()}"
                    )
                try:
                    if client.get(child.health_url).status_code == 200:
                        waiting.remove(child)
                except httpx.HTTPError:
                    pass
            if waiting and time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting)
                raise LaunchError(
                    f"{names} not healthy after {timeout_s:.0f} s; log {waiting[0].log_path}:\n"
                    f"{waiting[0].tail()}"
                )
            if waiting:
                time.sleep(poll_s)


def stop_children(children: list[Child], grace_s: float = 15.0) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after ``grace_s``."""
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        remaining = max(0.1, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=remaining)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)  # also reaps engine-core grandchildren
        child.proc.wait()
