"""The prefill process of ``scripts/bench_transfer.py``, and the decode process's handle on it.

The prefill process is spawned by the decode process on the same host
(:class:`SpawnedPrefill`). It owns two synthetic KV caches of one model
shape, cross-layer (``BLHNC``) and layer-compact (``LBHNC``), filled with
the pattern of :mod:`p2pkv.testing` (seed :func:`remote_seed`), each
registered and served by its own :class:`p2pkv.worker.WorkerSide` (NIXL
agent + side channel on ``--host``, ephemeral ports), progresses NIXL
(drains the decode's completion notifications) and, in push mode, WRITEs
requests into the decode's caches when asked
(:mod:`transfer_bench.push`) until told to stop. Everything
between the two processes goes over one pipe, sent and received in the
calling thread (a spinning thread holding the GIL cannot delay it).

Units: seconds unless named (``*_ms``: milliseconds, ``*_bytes``: bytes).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from p2pkv.testing import KVShape, make_shaped_kv_caches

from transfer_bench.options import PREFILL_CACHE_LAYOUTS, TransferBenchOptions, peak_rss_bytes, remote_seed
from transfer_bench.push import Pusher

if TYPE_CHECKING:
    import torch

    from p2pkv.worker import WorkerSide


def _prefill_main(shape_d: dict[str, Any], num_blocks: int, seed: int, nixl: dict[str, Any], host: str,
                  poll_s: float, device: str, conn: Any) -> None:
    """The spawned prefill process: both caches on ``device``, each registered and served by its own
    WorkerSide, until a ``stop`` message on the pipe end ``conn``; meanwhile it answers push messages and
    drains NIXL notifications every ``poll_s`` seconds.

    Sends ``{"op": "ready", "ready": layout → register_ms, port, device_id}`` once it serves, then
    ``{"op": "done", "notifs", "peak_rss_bytes", "peak_gpu_bytes"}`` (None on the CPU) when stopped, or
    ``{"op": "error", "error": traceback}`` when it fails.
    """
    import torch

    import p2pkv.worker as worker_module
    from p2pkv.config import P2pKvConfig
    from p2pkv.worker import WorkerSide

    workers: dict[str, WorkerSide] = {}
    try:
        dev = torch.device(device)
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.set_device(dev)
        worker_module.NIXL_PROGRESS_THREAD = nixl["progress_thread"]  # this process only
        config = P2pKvConfig(transfer_cpus=nixl["transfer_cpus"], insecure=True)  # synthetic: no secret
        shape, caches, ready = KVShape(**shape_d), [], {}
        for layout in PREFILL_CACHE_LAYOUTS:
            base, views = make_shaped_kv_caches(layout, shape, num_blocks, seed=remote_seed(seed, layout), device=dev)
            if cuda:
                torch.cuda.synchronize(dev)  # the pattern is in GPU memory before NIXL serves it
            caches.append(base)
            worker = workers[layout] = WorkerSide(f"bench-prefill-{layout}", config, 0, 1, host, 0,
                                                  "p2pkv-bench:" + shape.key(), shape.model_info(layout))
            t0 = time.perf_counter()
            worker.register_kv_caches(views, num_blocks)
            ready[layout] = {"register_ms": (time.perf_counter() - t0) * 1e3,
                             "port": worker.server.port if worker.server else 0,
                             "device_id": (dev.index or 0) if cuda else 0}
        pusher = Pusher(workers, {lay: r["device_id"] for lay, r in ready.items()}, num_blocks)
        conn.send({"op": "ready", "ready": ready})
        notifs = 0
        while True:
            if conn.poll(poll_s):  # wakes at once for a message
                msg = conn.recv()
                if msg.get("op") == "stop":
                    break
                conn.send(pusher.handle(msg))
            notifs += sum(len(w.agent.get_notifs()) for w in workers.values() if w.agent is not None)
        conn.send({"op": "done", "notifs": notifs, "peak_rss_bytes": peak_rss_bytes(),
                   "peak_gpu_bytes": torch.cuda.max_memory_reserved(dev) if cuda else None})
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send({"op": "error", "error": traceback.format_exc()})
    finally:
        for worker in workers.values():
            worker.shutdown()


class SpawnedPrefill:
    """The prefill process spawned on this host, and the pipe to it (readiness, push messages, statistics,
    failures).

    Attributes:
        proc: the process.
    """

    def __init__(self, opts: TransferBenchOptions, num_blocks: int, device: torch.device) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, name="p2pkv-bench-prefill", daemon=True,
                                args=(asdict(opts.shape), num_blocks, opts.seed, opts.nixl_settings(), opts.host,
                                      opts.prefill_poll_ms / 1e3, str(device), child))
        self.proc.start()
        child.close()

    def _gone(self, exc: BaseException) -> RuntimeError:
        return RuntimeError(f"prefill process gone (exit code {self.proc.exitcode}): {exc}")

    def send(self, msg: dict[str, Any]) -> None:
        """Send a message to it (push mode's: :mod:`transfer_bench.push`).

        Raises:
            RuntimeError: it is gone.
        """
        try:
            self.conn.send(msg)
        except OSError as exc:
            raise self._gone(exc) from exc

    def try_receive(self, timeout_s: float = 0.0) -> dict[str, Any] | None:
        """Its next message if one arrives within ``timeout_s`` seconds (default: has arrived), else None.

        Raises:
            RuntimeError: it is gone.
        """
        try:
            return self.conn.recv() if self.conn.poll(timeout_s) else None
        except (OSError, EOFError) as exc:
            raise self._gone(exc) from exc

    def receive(self, timeout_s: float) -> dict[str, Any]:
        """Its next message (waits up to ``timeout_s`` seconds).

        Raises:
            RuntimeError: it is gone, or sent nothing in time.
        """
        deadline = time.monotonic() + timeout_s
        while (msg := self.try_receive(min(0.5, max(0.0, deadline - time.monotonic())))) is None:
            if not self.proc.is_alive() or time.monotonic() >= deadline:
                raise RuntimeError(f"prefill process sent nothing within {timeout_s:g} s "
                                   f"(exit code {self.proc.exitcode})")
        return msg

    def _expect(self, op: str, timeout_s: float) -> dict[str, Any]:
        msg = self.receive(timeout_s)
        if msg.get("op") != op:
            raise RuntimeError(f"prefill process failed:\n{msg.get('error', msg)}")
        return msg

    def ready(self) -> dict[str, dict[str, Any]]:
        """Layout → ``register_ms``, ``port``, ``device_id`` once it serves (waits up to 300 s)."""
        return self._expect("ready", 300)["ready"]

    def finish(self) -> dict[str, Any]:
        """Stop it; its ``notifs``, ``peak_rss_bytes``, ``peak_gpu_bytes``."""
        self.send({"op": "stop"})
        return self._expect("done", 60)

    def close(self) -> None:
        """Stop it and wait (30 s, then kill)."""
        if self.proc.is_alive():
            with contextlib.suppress(RuntimeError):
                self.send({"op": "stop"})
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
