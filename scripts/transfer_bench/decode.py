"""The decode side of ``scripts/bench_transfer.py``: destination caches, one NIXL agent, the ways to pull.

:class:`Decode` holds two destination caches (``BLHNC`` and ``LBHNC``) on
one :class:`p2pkv.dataplane.agent.NixlTransferAgent`, fetches both prefill caches'
AgentInfo over their side channels (timed), and pulls requests (block ids
from :func:`p2pkv.testing.make_placements`) by one method at a time; see
``scripts/bench_transfer.py`` for the methods. In push mode it has the
prefill WRITE the same requests into the same destination blocks instead
(:meth:`Decode.verified_push`, :meth:`Decode.timed_push`;
:mod:`transfer_bench.push`). Units: seconds unless named
(``*_ms``: milliseconds); offsets and lengths in bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from p2pkv.dataplane.agent import NixlTransferAgent
from p2pkv.dataplane.plan import coalesce_runs
from p2pkv.testing import make_shaped_kv_caches, ranges_equal, run_ranges

from transfer_bench.options import (
    CUDA_MEMCPY_LABEL,
    METHODS,
    PEER_LAYOUT,
    PREFILL_CACHE_LAYOUTS,
    remote_seed,
)
from transfer_bench.push import PushClient, PushError, pair_descriptors

if TYPE_CHECKING:
    import torch

    from handshake import AgentInfo

    from transfer_bench.options import TransferBenchOptions
    from transfer_bench.prefill import SpawnedPrefill

_NOTIF = b"p2pkv:done:bench"


@dataclass
class _Side:
    """One layout as seen from the decode process."""

    raw: torch.Tensor
    segs: list[tuple[int, int, int]]
    local_segments: list[Any]
    remote_segments: list[Any]
    peer: str
    seed: int
    remote_device_id: int


class Decode:
    """The decode side: destination caches on ``device``, one NIXL agent, both peers.

    Args:
        opts: the benchmark's settings.
        num_blocks: blocks per cache (the prefill side's caches have as many).
        device: where the destination caches live.
    """

    def __init__(self, opts: TransferBenchOptions, num_blocks: int, device: torch.device) -> None:
        import torch

        from p2pkv.dataplane.agent import unique_agent_name
        from p2pkv.dataplane.layout import describe_torch_kv_caches

        self.opts, self.num_blocks, self.device = opts, num_blocks, device
        cuda = device.type == "cuda"
        self.mem_type, self.device_id = ("VRAM", device.index or 0) if cuda else ("DRAM", 0)
        labels = {**METHODS, "memcpy": CUDA_MEMCPY_LABEL} if cuda else dict(METHODS)
        self.labels = labels if "pull" in opts.modes else {"memcpy": labels["memcpy"]}
        """Method → what it measures: the pull methods (none without ``--mode pull``) and ``memcpy``."""
        self.sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        shape = opts.shape
        # Caches first: on a GPU the CUDA context then exists before UCX starts.
        made = {lay: make_shaped_kv_caches(lay, shape, num_blocks, seed=2 * opts.seed + 200 + i, device=device)
                for i, lay in enumerate(PREFILL_CACHE_LAYOUTS)}
        self.sync()
        self.agent = NixlTransferAgent(unique_agent_name("bench-decode", 0), ("UCX",), opts.progress_thread,
                                       opts.num_threads, split_bytes=int(opts.split_mib * 2**20))
        self.caches = {lay: base for lay, (base, _) in made.items()}
        self.layouts = {lay: describe_torch_kv_caches(views, num_blocks) for lay, (_, views) in made.items()}
        t0 = time.perf_counter()
        self.agent.register([r for lay in self.layouts.values() for r in lay.regions], self.mem_type, self.device_id)
        self.register_ms = (time.perf_counter() - t0) * 1e3
        self.pool_agent: NixlTransferAgent | None = None
        if opts.pool_threads > 0 and "pull" in opts.modes:
            # the same BLHNC memory on a second agent whose READs a thread pool moves
            self.pool_agent = NixlTransferAgent(unique_agent_name("bench-decode-pool", 0), ("UCX",),
                                                opts.progress_thread, opts.pool_threads,
                                                report_transport=False, split_bytes=int(opts.split_mib * 2**20))
            self.pool_agent.register(self.layouts["BLHNC"].regions, self.mem_type, self.device_id)
            self.labels["cross_layer_pool"] = (
                f"p2pkv cross-layer READs (as cross_layer) on NIXL's UCX thread pool: {opts.pool_threads} threads, "
                f"descriptors cut into {opts.split_mib:g} MiB pieces (a thread pool: transfer_cpus / READ_SPLIT_MIB)")
        self.peers: dict[str, dict[str, float]] = {}
        self.sides: dict[str, _Side] = {}
        self.pusher: PushClient | None = None
        """Push mode's decode end (:meth:`enable_push`); None without ``--mode push`` or ``stream``."""
        self._streams = 0

    def agent_infos(self) -> dict[str, AgentInfo]:
        """Layout → this side's AgentInfo for it: the decode agent's NIXL metadata and that destination
        cache's layout (what a prefill needs to WRITE into it)."""
        from handshake import AgentInfo, compute_digest
        from p2pkv.dataplane.negotiate import layout_desc

        meta, shape = self.agent.metadata(), self.opts.shape
        return {lay: AgentInfo(engine_id="bench-decode", tp_rank=0, tp_size=1, agent_name=self.agent.name,
                               agent_metadata=meta, metadata_digest=compute_digest(meta),
                               compat_hash="p2pkv-bench:" + shape.key(),
                               layout=layout_desc(local, shape.model_info(lay), "HND", mem_type=self.mem_type,
                                                  device_id=self.device_id))
                for lay, local in self.layouts.items()}

    def enable_push(self, link: SpawnedPrefill) -> None:
        """Push mode: hand the prefill this side's agent and layouts over ``link`` (the prefill's
        ``add_remote_agent`` times land in ``self.pusher.add_remote_agent_ms``)."""
        from p2pkv.notification import PUSH_PREFIX

        self.pusher = PushClient(link, self.agent, 60.0)
        self.pusher.connect(self.agent_infos(), self.device_id)
        self.agent.take_notifs(PUSH_PREFIX)  # stream mode's "pushed" notifications kept apart from now on

    def connect(self, ready: dict[str, Any], host: str) -> None:
        """Handshake with both prefill caches' side channels at ``host`` and load their metadata (timed).

        Args:
            ready: layout → ``port`` (side channel), ``register_ms``, ``device_id``, as the prefill reported them.
            host: the prefill's address.
        """
        import torch

        from handshake import Destination, fetch_agent_info
        from p2pkv.dataplane.negotiate import remote_segments

        opts, shape = self.opts, self.opts.shape
        for lay in PREFILL_CACHE_LAYOUTS:
            local, base = self.layouts[lay], self.caches[lay]
            t0 = time.perf_counter()
            info = fetch_agent_info(Destination(host, ready[lay]["port"], f"bench-prefill-{lay}", 0), "bench-decode",
                                    "p2pkv-bench:" + shape.key())
            t1 = time.perf_counter()
            name = self.agent.add_peer(info)
            t2 = time.perf_counter()
            if lay == "BLHNC" and self.pool_agent is not None:
                self.pool_agent.add_peer(info)
            self.peers[lay] = {"handshake_ms": (t1 - t0) * 1e3, "add_remote_agent_ms": (t2 - t1) * 1e3,
                               "setup_ms": (t2 - t0) * 1e3, "prefill_register_ms": ready[lay]["register_ms"]}
            origin = local.regions[0].addr
            self.sides[lay] = _Side(
                raw=base.view(-1).view(torch.uint8),
                segs=[(s.addr - origin, s.block_stride, s.length) for s in local.segments],
                local_segments=list(local.segments), remote_segments=remote_segments(info.layout),
                peer=name, seed=remote_seed(opts.seed, lay), remote_device_id=int(ready[lay].get("device_id", 0)))

    def plan(self, method: str, loc: np.ndarray, rem: np.ndarray) -> dict[str, Any]:
        """Descriptors (or memcpy runs) of one request; keys ``runs``, ``local``, ``remote``, ``descs``."""
        if method == "memcpy":
            runs = coalesce_runs(loc, rem, self.num_blocks, self.num_blocks)
            return {"runs": runs, "descs": int(runs[0].size)}
        side = self.sides[PEER_LAYOUT[method]]
        ld, rd = pair_descriptors(method, side.local_segments, loc, self.device_id, side.remote_segments, rem,
                                  side.remote_device_id, self.num_blocks)
        return {"local": ld, "remote": rd, "descs": int(ld.shape[0])}

    def execute(self, method: str, plan: dict[str, Any]) -> float:
        """Run one planned request; seconds (on a GPU, memcpy until its copies finished)."""
        if method == "memcpy":
            src, dst, bb = self.sides["BLHNC"].raw, self.sides["LBHNC"].raw, self.opts.shape.block_bytes
            ls, rs, lens = (a.tolist() for a in plan["runs"])
            self.sync()
            t0 = time.perf_counter()
            for a, b, n in zip(ls, rs, lens, strict=True):
                dst[a * bb:(a + n) * bb].copy_(src[b * bb:(b + n) * bb])
            self.sync()
            return time.perf_counter() - t0
        side = self.sides[PEER_LAYOUT[method]]
        agent = self.pool_agent if method == "cross_layer_pool" and self.pool_agent is not None else self.agent
        t0 = time.perf_counter()
        handle = agent.start_read(side.peer, plan["local"], plan["remote"], b"")
        while not agent.poll(handle):
            pass
        seconds = time.perf_counter() - t0
        agent.send_notif(side.peer, _NOTIF)  # as WorkerSide does: after the READ, off the timed path
        return seconds

    def close(self) -> None:
        """Close both NIXL agents. Idempotent."""
        self.agent.close()
        if self.pool_agent is not None:
            self.pool_agent.close()

    def _scrub(self, layout: str | None, loc: np.ndarray, rem: np.ndarray) -> Callable[[], bool | None]:
        """Zero a request's destination ranges in ``layout``'s cache (None: memcpy's) and return the
        check that they now equal the source (None when ``--no-verify``)."""
        runs = coalesce_runs(loc, rem, self.num_blocks, self.num_blocks)
        if layout is None:
            bb = self.opts.shape.block_bytes
            dst, src, seed = self.sides["LBHNC"].raw, self.sides["BLHNC"].raw, 0
            ranges = run_ranges([(0, bb, bb)], *runs)
        else:
            side = self.sides[layout]
            dst, src, seed = side.raw, None, side.seed
            ranges = run_ranges(side.segs, *runs)
        for d, _, n in ranges:
            dst[d:d + n].zero_()
        self.sync()  # scrubbed before NIXL (its own CUDA streams) writes
        return lambda: ranges_equal(dst, ranges, src, seed) if self.opts.verify else None

    def verified_pull(self, method: str, loc: np.ndarray, rem: np.ndarray) -> bool | None:
        """Scrub a request's destination, pull it (a peer's first pull: its ``first_pull_ms``), compare
        with the source: equal (None: not checked)."""
        check = self._scrub(None if method == "memcpy" else PEER_LAYOUT[method], loc, rem)
        seconds = self.execute(method, self.plan(method, loc, rem))
        if method in PEER_LAYOUT and method != "cross_layer_pool":
            self.peers[PEER_LAYOUT[method]].setdefault("first_pull_ms", seconds * 1e3)
        return check()

    def verified_push(self, method: str, loc: np.ndarray, rem: np.ndarray) -> bool | None:
        """Scrub a request's destination, have the prefill push it, compare with the source: equal (None:
        not checked)."""
        check = self._scrub(PEER_LAYOUT[method], loc, rem)
        self.timed_push(method, loc, rem)
        return check()

    def timed_push(self, method: str, loc: np.ndarray, rem: np.ndarray) -> tuple[float, float, float, int]:
        """One push of a request into this side's blocks ``loc`` from the prefill's ``rem``:
        ``(the prefill's planning seconds, seconds from the ask to the notification, the prefill's
        post -> DONE seconds, descriptors)``.

        Raises:
            transfer_bench.push.PushError: the prefill could not push (or push mode is off).
        """
        if self.pusher is None:
            raise PushError("push mode is not enabled (enable_push)")
        self.sync()
        return self.pusher.push(method, np.asarray(loc), np.asarray(rem))

    def timed_stream(self, method: str, way: str, loc: np.ndarray, rem: np.ndarray) -> dict[str, float]:
        """One request WRITTEN by the prefill while (``way`` ``stream``) or after (``bulk``) its stand-in forward
        computes it: :func:`transfer_bench.stream.timed_stream`'s times.

        Raises:
            RuntimeError: the prefill could not stream (or push mode is off).
        """
        from transfer_bench.stream import stream_request, timed_stream

        if self.pusher is None:
            raise PushError("push mode is not enabled (enable_push)")
        self.sync()
        self._streams += 1
        shape = self.opts.shape
        msg = stream_request(method, way, self._streams, shape.num_layers, len(loc) * shape.block_size,
                             shape.page_bytes, self.opts.layer_ms, str(self.device), self.opts.poster,
                             self.opts.forward_stream, np.asarray(loc), np.asarray(rem))
        return timed_stream(self.pusher.link, self.agent, msg, 60.0)

    def verified_stream(self, method: str, way: str, loc: np.ndarray, rem: np.ndarray) -> bool | None:
        """Scrub a request's destination, have the prefill stream it, compare with the source."""
        check = self._scrub(PEER_LAYOUT[method], loc, rem)
        self.timed_stream(method, way, loc, rem)
        return check()

    def timed(self, method: str, loc: np.ndarray, rem: np.ndarray) -> tuple[float, float, int]:
        """``(planning seconds, pull seconds, descriptors)`` of one request."""
        t0 = time.perf_counter()
        plan = self.plan(method, loc, rem)
        t1 = time.perf_counter()
        return t1 - t0, self.execute(method, plan), plan["descs"]

