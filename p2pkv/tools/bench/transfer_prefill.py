"""The prefill process of ``p2pkv bench transfer``, and the decode process's handle on it.

The prefill process is spawned by the decode process on the same host
(:class:`SpawnedPrefill`). It owns two synthetic KV caches of one model
shape, cross-layer (``BLHNC``) and layer-compact (``LBHNC``), filled with
the pattern of :mod:`p2pkv.testing` (seed :func:`remote_seed`), each
registered and served by its own :class:`p2pkv.worker.WorkerSide` (NIXL
agent + side channel on ``--host``, ephemeral ports), progresses NIXL
(drains the decode's completion notifications) and, in push mode, WRITEs
requests into the decode's caches when asked over a pipe
(:mod:`p2pkv.tools.bench.transfer_push`) until told to stop.

Units: seconds unless named (``*_ms``: milliseconds, ``*_bytes``: bytes).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from p2pkv.testing import KVShape, make_shaped_kv_caches
from p2pkv.tools.bench import machine
from p2pkv.tools.bench.transfer_options import PREFILL_CACHE_LAYOUTS, TransferBenchOptions, remote_seed
from p2pkv.tools.bench.transfer_push import Pusher

if TYPE_CHECKING:
    import torch

    from p2pkv.worker import WorkerSide


class PrefillCaches:
    """Both caches on ``device``, each registered and served by its own WorkerSide.

    Args:
        shape: KV geometry.
        num_blocks: blocks per cache.
        seed: the benchmark's ``--seed`` (pattern seeds: :func:`remote_seed`).
        nixl: :class:`p2pkv.config.P2pKvConfig` keywords.
        host: side-channel bind address.
        device: torch device string.

    Attributes:
        ready: layout → ``register_ms``, ``port`` (side channel), ``device_id``.
    """

    def __init__(self, shape: KVShape, num_blocks: int, seed: int, nixl: dict[str, Any], host: str,
                 device: str) -> None:
        import torch

        from p2pkv.config import P2pKvConfig
        from p2pkv.worker import WorkerSide

        self.device = dev = torch.device(device)
        self.cuda = dev.type == "cuda"
        self.workers: list[WorkerSide] = []
        self.caches: list[torch.Tensor] = []
        self.ready: dict[str, dict[str, Any]] = {}
        self.num_blocks = num_blocks
        if self.cuda:
            torch.cuda.set_device(dev)
        config = P2pKvConfig(**nixl, insecure=True)  # synthetic caches: nothing secret to guard
        try:
            for layout in PREFILL_CACHE_LAYOUTS:
                base, views = make_shaped_kv_caches(layout, shape, num_blocks, seed=remote_seed(seed, layout),
                                                    device=dev)
                if self.cuda:
                    torch.cuda.synchronize(dev)  # the pattern is in GPU memory before NIXL serves it
                self.caches.append(base)
                worker = WorkerSide(f"bench-prefill-{layout}", config, 0, 1, host, 0,
                                    "p2pkv-bench:" + shape.key(), shape.model_info(layout))
                self.workers.append(worker)
                t0 = time.perf_counter()
                worker.register_kv_caches(views, num_blocks)
                self.ready[layout] = {"register_ms": (time.perf_counter() - t0) * 1e3,
                                      "port": worker.server.port if worker.server else 0,
                                      "device_id": (dev.index or 0) if self.cuda else 0}
        except BaseException:
            self.close()
            raise

    def pusher(self) -> Pusher:
        """Push mode's prefill end over these caches' agents (:mod:`p2pkv.tools.bench.transfer_push`)."""
        return Pusher(dict(zip(PREFILL_CACHE_LAYOUTS, self.workers, strict=True)),
                      {lay: r["device_id"] for lay, r in self.ready.items()}, self.num_blocks)

    def drain(self) -> int:
        """Progress NIXL once: completion notifications received (count)."""
        return sum(len(w.agent.get_notifs()) for w in self.workers if w.agent is not None)

    def stats(self, notifs: int) -> dict[str, Any]:
        """``notifs`` (count), ``peak_rss_bytes``, ``peak_gpu_bytes`` (None on the CPU) of this process."""
        import torch

        return {"notifs": notifs, "peak_rss_bytes": machine.peak_rss_bytes(),
                "peak_gpu_bytes": torch.cuda.max_memory_reserved(self.device) if self.cuda else None}

    def close(self) -> None:
        """Shut every WorkerSide down (side channels, NIXL agents). Idempotent."""
        for worker in self.workers:
            worker.shutdown()


def _prefill_main(shape_d: dict[str, Any], num_blocks: int, seed: int, nixl: dict[str, Any], host: str,
                  poll_s: float, device: str, out: Any, stop: Any, push: Any) -> None:
    """The spawned prefill process: serve both caches until ``stop``, draining notifications
    and answering push messages on the pipe end ``push``."""
    caches: PrefillCaches | None = None
    try:
        caches = PrefillCaches(KVShape(**shape_d), num_blocks, seed, nixl, host, device)
        pusher = caches.pusher()
        out.put(("ready", caches.ready))
        notifs = 0
        while not stop.is_set():
            if push.poll(poll_s):  # wakes at once for a push request
                push.send(pusher.handle(push.recv()))  # sent from this thread: no queue feeder thread to wait for
            notifs += caches.drain()
        out.put(("done", caches.stats(notifs)))
    except BaseException:
        out.put(("error", traceback.format_exc()))
    finally:
        if caches is not None:
            caches.close()


class SpawnedPrefill:
    """The prefill process spawned on this host, talked to over multiprocessing queues (readiness,
    statistics, failures) and a pipe (push mode's messages, sent and received in the calling thread so
    that a spinning thread holding the GIL cannot delay them).

    Attributes:
        proc: the process.
    """

    def __init__(self, opts: TransferBenchOptions, num_blocks: int, device: torch.device) -> None:
        ctx = mp.get_context("spawn")
        self.out, self.stop = ctx.Queue(), ctx.Event()
        self.push, child_push = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, name="p2pkv-bench-prefill", daemon=True,
                                args=(asdict(opts.shape), num_blocks, opts.seed, opts.nixl_settings(), opts.host,
                                      opts.prefill_poll_ms / 1e3, str(device), self.out, self.stop, child_push))
        self.proc.start()
        child_push.close()

    def _expect(self, tag: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (self.proc.is_alive() or not self.out.empty()):
            try:
                got, payload = self.out.get(timeout=0.5)
            except queue.Empty:
                continue
            if got == "error":
                raise RuntimeError(f"prefill process failed:\n{payload}")
            if got == tag:
                return payload
        raise RuntimeError(f"prefill process sent no {tag!r} within {timeout_s:g} s (exit code {self.proc.exitcode})")

    def ready(self) -> dict[str, dict[str, Any]]:
        """Layout → ``register_ms``, ``port``, ``device_id`` once it serves (waits up to 300 s)."""
        return self._expect("ready", 300)

    def send(self, msg: dict[str, Any]) -> None:
        """Send a push message to it (:mod:`p2pkv.tools.bench.transfer_push`).

        Raises:
            RuntimeError: it is gone.
        """
        try:
            self.push.send(msg)
        except OSError as exc:
            raise RuntimeError(f"prefill process gone (exit code {self.proc.exitcode}): {exc}") from exc

    def receive(self, timeout_s: float) -> dict[str, Any]:
        """Its next reply to a push message (waits up to ``timeout_s`` seconds).

        Raises:
            RuntimeError: it failed, or sent no reply in time.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self.try_receive(min(0.5, max(0.0, deadline - time.monotonic())))
            if reply is not None:
                return reply
            if not self.proc.is_alive():
                self._expect("reply", 1)  # raises with its traceback if it sent one
        raise RuntimeError(f"prefill process sent no push reply within {timeout_s:g} s")

    def try_receive(self, timeout_s: float = 0.0) -> dict[str, Any] | None:
        """Its next reply to a push message if one arrives within ``timeout_s`` seconds (default: has
        arrived), else None.

        Raises:
            RuntimeError: it is gone.
        """
        try:
            return self.push.recv() if self.push.poll(timeout_s) else None
        except (OSError, EOFError) as exc:
            raise RuntimeError(f"prefill process gone (exit code {self.proc.exitcode}): {exc}") from exc

    def finish(self) -> dict[str, Any]:
        """Stop it; its ``notifs``, ``peak_rss_bytes``, ``peak_gpu_bytes``."""
        self.stop.set()
        return self._expect("done", 60)

    def close(self) -> None:
        """Stop it and wait (30 s, then kill)."""
        self.stop.set()
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.push.close()

