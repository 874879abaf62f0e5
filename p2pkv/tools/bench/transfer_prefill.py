"""The prefill side of ``p2pkv bench transfer``, and the decode side's handle on it.

The prefill side owns two synthetic KV caches of one model shape,
cross-layer (``BLHNC``) and layer-compact (``LBHNC``), filled with the
pattern of :mod:`p2pkv.testing` (seed :func:`remote_seed`), each
registered and served by its own :class:`p2pkv.worker.WorkerSide` (NIXL
agent + side channel), progresses NIXL (drains the decode's completion
notifications) and, in push mode, WRITEs requests into the decode's caches
when asked (:mod:`p2pkv.tools.bench.transfer_push`) until told to stop. It
runs either

* as a process spawned by the decode process on the same host
  (``--role both``; :class:`SpawnedPrefill`, multiprocessing queues), or
* in the foreground on its own node (``--role prefill``; :func:`serve`),
  reached by the decode side (``--role decode --peer HOST``;
  :class:`RemotePrefill`) over the control channel of
  :mod:`p2pkv.tools.bench.transfer_control`. Side channels: ``BLHNC`` on
  ``--port``, ``LBHNC`` on ``--port + 1``; control on ``--control-port``
  (default ``--port + 2``). It exits 0 when a decode says ``done``, 1 when
  ``--serve-seconds`` pass first, 0 on SIGTERM/SIGINT.

Units: seconds unless named (``*_ms``: milliseconds, ``*_bytes``: bytes).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import socket
import threading
import time
import traceback
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from p2pkv.testing import KVShape, make_shaped_kv_caches
from p2pkv.tools.bench import machine
from p2pkv.tools.bench.transfer_control import ControlClient, ControlServer
from p2pkv.tools.bench.transfer_options import (
    PREFILL_CACHE_LAYOUTS,
    TransferBenchOptions,
    control_port,
    log,
    remote_seed,
)
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
        port: side-channel port of the first cache, the next one's is ``port + 1`` (0: ephemeral ports).

    Attributes:
        ready: layout → ``register_ms``, ``port`` (side channel), ``device_id``.
    """

    def __init__(self, shape: KVShape, num_blocks: int, seed: int, nixl: dict[str, Any], host: str, device: str,
                 port: int = 0) -> None:
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
            for i, layout in enumerate(PREFILL_CACHE_LAYOUTS):
                base, views = make_shaped_kv_caches(layout, shape, num_blocks, seed=remote_seed(seed, layout),
                                                    device=dev)
                if self.cuda:
                    torch.cuda.synchronize(dev)  # the pattern is in GPU memory before NIXL serves it
                self.caches.append(base)
                worker = WorkerSide(f"bench-prefill-{layout}", config, 0, 1, host, port + i if port else 0,
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
    """Spawned prefill process (``--role both``): serve both caches until ``stop``, draining notifications
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
    """``--role both``: the prefill process spawned on this host, talked to over multiprocessing queues
    (readiness, statistics, failures) and a pipe (push mode's messages, sent and received in the calling
    thread so that a spinning thread holding the GIL cannot delay them).

    Attributes:
        host: its side-channel address. local_address: this side's (the same).
        hostname: its host name (this host's). machine: None (it is this machine).
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
        self.host = self.local_address = opts.host
        self.hostname = socket.gethostname()
        self.machine: dict[str, Any] | None = None

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


class RemotePrefill:
    """``--role decode``: the prefill at ``--peer``, over the control channel.

    Connects and says hello at once (so a bad ``--peer`` fails before any
    cache is allocated), then checks that the prefill's caches are the ones
    this side's flags describe.

    Attributes:
        host: the prefill's address (``--peer``; its side channels are there).
        local_address: this side's address on the control connection.
        hostname: the prefill's host name. machine: its :func:`p2pkv.tools.bench.machine.machine_info`.

    Raises:
        PeerError: nothing answers at ``--peer`` within ``--peer-timeout``.
        ValueError: the prefill's shape, blocks per cache or seed differ from this side's.
    """

    def __init__(self, opts: TransferBenchOptions, num_blocks: int, device: torch.device) -> None:
        self.host = opts.peer
        self.client = ControlClient(opts.peer, control_port(opts), opts.peer_timeout_s)
        try:
            self.info = self.client.request(
                {"op": "hello", "hostname": socket.gethostname(), "shape": opts.shape.key(),
                 "num_blocks": num_blocks, "seed": opts.seed, "device": str(device)}, "ready", opts.peer_timeout_s)
            mine = {"shape": opts.shape.key(), "num_blocks": num_blocks, "seed": opts.seed}
            diff = [f"{k} {self.info.get(k)!r} there, {v!r} here" for k, v in mine.items() if self.info.get(k) != v]
            if diff:
                raise ValueError(
                    f"--peer {opts.peer}: the prefill's caches differ from this side's ({'; '.join(diff)}); start "
                    "both sides with the same shape flags (--layers --kv-heads --head-dim --dtype --block-size), "
                    "the same --num-blocks/--max-mem-gib/--tokens/--requests and the same --seed")
        except BaseException:
            self.client.close()
            raise
        self.local_address = self.client.local_address
        self.hostname: str = self.info.get("hostname", "")
        self.machine: dict[str, Any] | None = self.info.get("machine")

    def ready(self) -> dict[str, dict[str, Any]]:
        """Layout → ``register_ms``, ``port``, ``device_id``, as the prefill reported them."""
        return self.info["layouts"]

    def finish(self) -> dict[str, Any]:
        """Tell the prefill this side is done (it exits); its ``notifs``, ``peak_rss_bytes``, ``peak_gpu_bytes``."""
        return self.client.request({"op": "done"}, "bye", 60)

    def send(self, msg: dict[str, Any]) -> None:
        """Send a push message to it (:mod:`p2pkv.tools.bench.transfer_push`).

        Raises:
            PeerError: the control connection failed.
        """
        self.client.send(msg)

    def receive(self, timeout_s: float) -> dict[str, Any]:
        """Its next reply to a push message (waits up to ``timeout_s`` seconds).

        Raises:
            PeerError: it closed the connection or sent no reply in time.
        """
        return self.client.receive(None, timeout_s, "push")

    def try_receive(self) -> dict[str, Any] | None:
        """Its next reply to a push message if a whole one has arrived, else None.

        Raises:
            PeerError: the control connection failed.
        """
        return self.client.try_receive()

    def close(self) -> None:
        """Close the control connection (a prefill not told ``done`` waits for the next decode)."""
        self.client.close()


def serve(opts: TransferBenchOptions, num_blocks: int, device: torch.device) -> int:
    """``--role prefill``: serve both caches in the foreground until a decode is done.

    Prints ``ready: ...`` (side-channel and control addresses) on stdout once
    the caches are served, then progresses NIXL every ``--prefill-poll-ms``
    and answers the control channel (:mod:`p2pkv.tools.bench.transfer_control`).

    Returns:
        0 after a decode said ``done`` (or on SIGTERM/SIGINT), 1 when
        ``--serve-seconds`` passed first.

    Raises:
        ValueError: a side-channel or the control port cannot be bound (the message names the flag).
    """
    from handshake.errors import HandshakeBindError

    stopped: list[int] = []
    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    caches: PrefillCaches | None = None
    control: ControlServer | None = None
    try:
        try:
            caches = PrefillCaches(opts.shape, num_blocks, opts.seed, opts.nixl_settings(), opts.host, str(device),
                                   opts.port)
        except HandshakeBindError as exc:
            raise ValueError(f"--port {opts.port}: cannot serve the side channels on ports {opts.port} and "
                             f"{opts.port + 1}: {exc}") from exc
        try:
            control = ControlServer(opts.host, control_port(opts))
        except OSError as exc:
            raise ValueError(f"--control-port {control_port(opts)}: cannot listen on {opts.host}: {exc}") from exc
        hello = {"op": "ready", "layouts": caches.ready, "shape": opts.shape.key(), "num_blocks": num_blocks,
                 "seed": opts.seed, "device": str(device), "hostname": socket.gethostname(), "host": opts.host,
                 "machine": machine.machine_info(str(device))}
        sides = ", ".join(f"{lay} on {opts.host}:{r['port']}" for lay, r in caches.ready.items())
        print(f"ready: prefill serving {sides}; control on {opts.host}:{control.port} (until a decode says done, "
              f"SIGTERM or {opts.serve_seconds:g} s)", flush=True)
        deadline, notifs, greeted = time.monotonic() + opts.serve_seconds, 0, False
        pusher = caches.pusher()
        poll_s = opts.prefill_poll_ms / 1e3
        while not stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                log(False, f"--serve-seconds {opts.serve_seconds:g}: no decode said done in time; exiting")
                return 1
            msg = control.poll(min(poll_s, left))
            notifs += caches.drain()
            op = None if msg is None else msg.get("op")
            if op == "hello":
                greeted = True
                log(opts.quiet, f"decode {msg.get('hostname')} ({control.peer}) connected")
                control.reply(hello)
            elif op == "done":
                notifs += caches.drain()
                control.reply({"op": "bye", **caches.stats(notifs)})
                log(opts.quiet, f"decode done ({notifs} notifications); exiting")
                return 0
            elif isinstance(op, str) and op.startswith("push"):
                control.reply(pusher.handle(msg))
            elif op == "closed" and greeted:
                greeted, pusher = False, caches.pusher()  # the next decode starts with no plans
                log(opts.quiet, "decode left without saying done; waiting for the next one")
            elif op is not None and op != "closed":
                control.reply({"op": "error", "error": f"unknown op {op!r}"})
        log(opts.quiet, f"stopped by signal {stopped[0]}")
        return 0
    finally:
        if control is not None:
            control.close()
        if caches is not None:
            caches.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
