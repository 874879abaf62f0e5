"""``p2pkv launch prefill|decode`` run as a pod runs it, for the engine suites: started, waited for, stopped with
SIGTERM and checked to have stopped its engine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class PodLaunch:
    """One ``p2pkv launch <role>`` process and what it printed.

    Attributes:
        proc: the launcher process.
        port: the engine's HTTP port on 127.0.0.1.
        role: ``prefill`` or ``decode``.
        lines: what the launcher printed so far (stdout and stderr).
        pgid: the engine's process group, once the launcher printed it.
    """

    proc: subprocess.Popen
    port: int
    role: str
    lines: list[str] = field(default_factory=list)
    pgid: int | None = None

    @classmethod
    def start(cls, model: Path, port: int, side_channel_port: int, log_dir: Path, secret: str,
              flags: tuple[str, ...] = (), role: str = "prefill") -> PodLaunch:
        """Start ``p2pkv launch <role>`` for ``model`` on 127.0.0.1 (HTTP ``port``, side channel
        ``side_channel_port``), its engine log in ``log_dir``, ``secret`` as ``P2PKV_SECRET``, more ``flags``."""
        argv = [sys.executable, "-m", "p2pkv.tools.cli", "launch", role, "--model", str(model), "--dtype", "float32",
                "--host", "127.0.0.1", "--port", str(port), "--side-channel-host", "127.0.0.1",
                "--side-channel-port", str(side_channel_port), "--log-dir", str(log_dir), "--no-echo", *flags]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "P2PKV_SECRET": secret, "UCX_NET_DEVICES": "lo"})
        launch = cls(proc, port, role)
        threading.Thread(target=lambda: launch.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
        return launch

    def wait_ready(self, timeout_s: float) -> None:
        """Until the launcher prints ``ready:`` and the engine's ``/health`` answers 200.

        Raises:
            AssertionError: the launcher exited or ``timeout_s`` seconds passed (with what it printed).
        """
        deadline = time.monotonic() + timeout_s
        while not any(x.startswith("ready:") for x in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.5)
        (pid_line,) = [x for x in self.lines if x.startswith(f"{self.role}: pid ")]
        self.pgid = int(pid_line.split("process group ")[1].split(")")[0])
        assert httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200

    def stop_and_check(self) -> None:
        """SIGTERM: the launcher says it stops the engine, exits 0, and the engine's process group is gone.

        Raises:
            AssertionError: any of these does not happen (within 60 s / 10 s).
        """
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, "".join(self.lines)
        time.sleep(0.5)  # the reader thread takes the last lines
        assert any("got SIGTERM, stopping the engine" in x for x in self.lines), "".join(self.lines)
        deadline = time.monotonic() + 10
        while self.pgid is not None:
            try:
                os.killpg(self.pgid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"engine process group {self.pgid} still alive"
            time.sleep(0.2)

    def kill(self) -> None:
        """Whatever is left, killed (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
