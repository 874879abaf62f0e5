"""The connector's worker side for one tp_rank (of one pipeline stage): what vLLM calls on each worker process.

Registers the KV memory with NIXL and serves its description on the side
channel; on the decode side hands each step's pulls to
:class:`p2pkv.decode.receiver.Receiver`; on the prefill side holds finished
requests' blocks (:class:`p2pkv.prefill.holds.PrefillHolds`) until every
decode reader has said "done" (:mod:`p2pkv.notification`) or the lease ends,
and WRITEs them into decode ranks that ask, after the prefill (push mode, :class:`p2pkv.prefill.pusher.Pusher`)
or layer by layer during it (stream mode, :class:`p2pkv.prefill.prefill_streams.PrefillStreams`), both on one
WRITE thread (:class:`p2pkv.prefill.write_engine.WriteEngine`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from handshake import AgentInfo, HandshakeServer, KVLayoutDesc, compute_digest
from p2pkv.config import P2pKvConfig, Role
from p2pkv.dataplane.agent import NixlTransferAgent, unique_agent_name
from p2pkv.dataplane.digest import check_host
from p2pkv.dataplane.layers import groups_by_layer
from p2pkv.dataplane.layout import (
    KVLayout,
    LayoutError,
    attn_layout_of,
    check_state_views,
    describe_torch_kv_caches,
    tensor_info,
)
from p2pkv.dataplane.negotiate import ModelInfo, layout_desc
from p2pkv.dataplane.rank import LocalRank
from p2pkv.dataplane.stager import Stager
from p2pkv.dataplane.stages import StageLayers, stage_desc
from p2pkv.dataplane.transport import TransportReport
from p2pkv.decode.receiver import Receiver
from p2pkv.decode.transfer import streams_only
from p2pkv.faults import load_faults
from p2pkv.metadata import P2pKvMetadata
from p2pkv.notification import parse_done
from p2pkv.prefill.hold_digests import HoldDigests
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.layer_stream import StreamSide
from p2pkv.prefill.prefill_streams import PrefillStreams, layer_indices
from p2pkv.prefill.pusher import Pusher
from p2pkv.prefill.stream_measures import MIN_LINK_SHARE
from p2pkv.prefill.stream_requests import stream_side
from p2pkv.prefill.write_engine import WriteEngine
from p2pkv.telemetry.hold_spans import HoldTraces
from p2pkv.telemetry.stats import StatsBuffer, add_counts
from p2pkv.transfer_threads import nixl_threads, parse_cpus, pinned, start_transfer_thread
from p2pkv.ways import WAYS

logger = logging.getLogger("p2pkv.worker")

SWITCH_INTERVAL_S = 0.0005
"""Python's thread switch interval (seconds) a registered worker lowers its process to (``sys.setswitchinterval``,
never raised), so the side-channel server and the pulls' thread get the interpreter within it while vLLM's
engine thread runs Python. At Python's default, 5 ms, a fence question to a busy worker over one long-lived
connection took 5.7 ms at p50 and 11.6 ms at p90; at 0.5 ms, 0.22 and 0.82 ms
(docs/benchmarks/handover.md, "Fence round trip against a busy worker")."""

IDLE_WAIT_S = 0.002
"""Longest time (seconds) a worker waits, at the end of an engine step that scheduled no tokens, for a pull to
finish while pulls or holds are pending: vLLM steps such an engine back to back only to poll transfers, which
kept a core busy for as long as a pull ran or blocks were held. The wait ends at once when a pull finishes; a
request arriving meanwhile waits up to this long. At concurrency 4 the same 48 requests took half the time with
it and TTFT p50 fell 1.7-3.4x; at concurrency 1 nothing changed (docs/benchmarks/handover.md, "Idle engine steps
wait for the pull")."""

STREAM_IDLE_WAIT_S = 0.02
""":data:`IDLE_WAIT_S` while every pull under way is a layer stream waiting for its prefill (a wait as long as the
prefill's forward): the pulls' thread ends it as soon as a stream lands, so it adds nothing to a stream; a
request arriving meanwhile at an otherwise idle decode engine waits up to this long. With the stream poll pace
(:data:`p2pkv.decode.transfer.STREAM_POLL_MIN_S`) it cut a waiting decode engine's CPU from 5.3-6.6 to 2.2-2.4
CPU-s per 1k-token stream on a 2-core host (docs/streaming.md, docs/benchmarks/stream-serve-cpu.md)."""

SIDE_CHANNEL_STALL_S = 5.0
"""Seconds a rank's side-channel loop (it answers every fence question, heartbeat and push request) may go
without a turn before a WARNING with every thread's stack is logged, once per stall: far above any turn of a
healthy loop (a fence round trip is below a millisecond at p90, docs/benchmarks/handover.md) and at the
default ``handshake_timeout_s``, past which a peer's request fails anyway."""

NIXL_PROGRESS_THREAD = False
"""NIXL's progress thread stays off: it keeps a core busy per agent, and for layer streams it did not remove
the cost of posting WRITEs and made ``cuda_ipc`` streams slower (docs/streaming.md, "A poster thread, never the
forward's"); p2pkv progresses transfers from its own threads."""

READ_SPLIT_MIB = 4.0
"""With a thread pool (``transfer_cpus`` of two cores or more), READ descriptors are cut into pieces of at most
this many MiB so NIXL's UCX thread pool shares one READ: 2 threads READ host memory about 1.3x faster than one
where a core is free (docs/benchmarks/transfer-cpu.md, measured with 4 MiB pieces)."""


def way_handlers(pusher: Pusher, streams: PrefillStreams) -> dict[str, Callable[..., Any]]:
    """The prefill worker's side-channel handler of each way (:data:`p2pkv.ways.WAYS`), keyed by the
    :class:`handshake.HandshakeServer` keyword its :class:`~p2pkv.ways.Way` names: pull's fence questions go
    to the hold callback (which also answers every way's lease heartbeats), push requests to the
    :class:`~p2pkv.prefill.pusher.Pusher`, stream requests to the
    :class:`~p2pkv.prefill.prefill_streams.PrefillStreams`.

    Raises:
        KeyError: a way of the registry has no handler here.
    """
    by_way: dict[str, Callable[..., Any]] = {"pull": streams.on_heartbeat, "push": pusher.on_push,
                                             "stream": streams.on_stream}
    return {way.handler: by_way[name] for name, way in WAYS.items()}


def rank_streams(engine_id: str, config: P2pKvConfig, secret: bytes | None, writes: WriteEngine, holds: PrefillHolds,
                 desc: KVLayoutDesc, tensors: dict[str, Any], *, on_gpu: bool, layer_groups: dict[str, int] | None,
                 state_groups: frozenset[int], stage: StageLayers | None, pp_size: int) -> PrefillStreams:
    """A prefill rank's layer streams: its pages (``desc``) as their source, or why they cannot stream (an
    interleaved layout: such requests go without a grant), the layers of ``tensors`` (layer name → KV tensor)
    as vLLM saves them, the settings that shape them (``stream_min_tokens``, ``max_lifetime_s``) and ``secret``
    (checks grants; None: nothing streams).
    ``stage``: the rank's pipeline stage (None: every layer) of the engine's ``pp_size`` stages."""
    try:
        source: StreamSide | str = stream_side(desc)
    except LayoutError as exc:
        source = f"this rank's KV layout cannot be streamed layer by layer ({exc}); send without a grant (push)"
    return PrefillStreams(engine_id, writes, holds, source, layer_indices(tensors), secret,
                          on_gpu=on_gpu, min_tokens=config.stream_min_tokens,
                          min_link_share=0.0 if config.stream_min_tokens == 0 else MIN_LINK_SHARE,
                          group_of=layer_groups, state_groups=state_groups, max_lifetime_s=config.max_lifetime_s,
                          stage=stage, pp_size=pp_size)


def released_holds(agent: NixlTransferAgent, secret: bytes | None, holds: PrefillHolds,
                   streams: PrefillStreams | None, stats: StatsBuffer, traces: HoldTraces) -> set[str]:
    """The request ids a rank's holds free now: those every decode reader has notified "done" (NIXL
    notifications read from ``agent``, their MAC checked with ``secret``; others dropped and counted in a log
    line), or whose lease expired (:meth:`p2pkv.prefill.holds.PrefillHolds.released`, counted in ``stats``). A
    rank's layer ``streams`` (None on a decode rank) collect their WRITEs' ends first and are told which holds
    ended; every hold that ended closes its span in ``traces``. Never raises for a broken peer: a notification
    read that fails is logged and the step goes on."""
    try:
        notifs = agent.get_notifs()
    except Exception as exc:  # a broken peer must not lose this step's results
        logger.warning("p2pkv: reading NIXL notifications failed: %s", exc)
        notifs = []
    notes = [n for n in (parse_done(m, secret) for m in notifs) if n is not None]
    if len(notes) < len(notifs):
        logger.warning("p2pkv: %d NIXL notification(s) dropped: not p2pkv \"done\" messages, or their MAC "
                       "is wrong (a decode engine with another secret?)", len(notifs) - len(notes))
    if streams is not None:
        streams.collect()
    released = holds.released(notes, stats.data)
    if streams is not None and released:
        streams.holds_ended(released)
    endings, holds.endings = holds.endings, {}
    traces.ended(endings)
    return released


class WorkerSide:
    """The connector's worker-side half for one tp_rank (of one pipeline stage).

    Args:
        engine_id: this engine's id.
        config: p2pkv settings (a side-channel secret, or ``insecure``).
        tp_rank: this worker's tensor-parallel rank.
        tp_size: this engine's tensor-parallel size.
        side_channel_host: address the side-channel server binds to.
        side_channel_port: this rank's side-channel port.
        compat_hash: the compatibility fingerprint peers must match (:func:`p2pkv.engine_facts.compat_fields`).
        model: this rank's model and KV cache facts.
        pp_rank / pp_size: this worker's pipeline stage and the engine's stages (a prefill engine only,
            :func:`p2pkv.engine_facts.check_parallelism_supported`): it registers and serves its stage's layers,
            its handshake naming the stage and its first layer.
        role: what this engine does (:func:`p2pkv.config.engine_role`): a ``decode`` rank holds nothing for
            anyone, so it builds no :class:`~p2pkv.prefill.pusher.Pusher` and no
            :class:`~p2pkv.prefill.prefill_streams.PrefillStreams` (its side channel refuses push and stream
            requests, and answers hold questions from its empty holds). A ``prefill`` rank loads nothing, so
            it builds no :class:`~p2pkv.decode.receiver.Receiver` (its scheduler computes a request that asks
            it to load KV: :meth:`p2pkv.scheduler.P2pKvScheduler.get_num_new_matched_tokens`).

    Raises:
        p2pkv.config.ConfigError: no side-channel secret and not ``insecure``.
    """

    def __init__(self, engine_id: str, config: P2pKvConfig, tp_rank: int, tp_size: int,
                 side_channel_host: str, side_channel_port: int, compat_hash: str, model: ModelInfo,
                 role: Role = "both", *, pp_rank: int = 0, pp_size: int = 1) -> None:
        self.engine_id = engine_id
        self.role = role
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.host = side_channel_host
        self.port = side_channel_port
        self.compat_hash = compat_hash
        self.model = model
        self.agent: NixlTransferAgent | None = None
        self.server: HandshakeServer | None = None
        self.layout: KVLayout | None = None
        self.desc: KVLayoutDesc | None = None
        self.receiver: Receiver | None = None
        self.writes: WriteEngine | None = None
        self.pusher: Pusher | None = None
        self.streams: PrefillStreams | None = None
        self._pushes_seen: dict[str, Any] = {}  # the pusher's counts at the last take_stats
        self._stager: Stager | None = None
        self.holds = PrefillHolds(config.lease_s)
        self._secret = config.require_secret()  # before anything starts: no secret, no side channel
        self.stats = StatsBuffer()
        self._closed = False
        self._idle = False  # this step scheduled no tokens
        self.hold_traces = HoldTraces(engine_id, tp_rank)

    @property
    def rank(self) -> int:
        """This worker's rank in its engine, ``pp_rank * tp_size + tp_rank`` (:attr:`handshake.AgentInfo.rank`)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def register_kv_caches(self, kv_caches: dict[str, Any], num_blocks: int,
                           state_layers: frozenset[str] = frozenset(), layer_groups: dict[str, int] | None = None,
                           state_groups: frozenset[int] = frozenset()) -> None:
        """Register this worker's KV tensors with NIXL and start serving their description.

        Args:
            kv_caches: layer name → KV tensor (any of vLLM's layouts; CPU or CUDA); for a Mamba layer
                its state (one ``[num_blocks, ...]`` view, or a list of them: conv, SSM), which must lie
                inside the attention tensors' pages (vLLM's hybrid KV cache shares them).
            num_blocks: blocks per layer.
            state_layers: names of the Mamba/SSM layers in ``kv_caches``.
            layer_groups: layer name → its KV cache group (None: one group).
            state_groups: the indices of the groups of ``state_layers``.

        Raises:
            p2pkv.dataplane.layout.LayoutError: a layout p2pkv cannot describe, state views outside
                the attention pages, or a pipeline stage whose layers are not consecutive model layers.
            p2pkv.dataplane.agent.TransferError: NIXL could not register the memory.
        """
        if 0 < SWITCH_INTERVAL_S < sys.getswitchinterval():
            sys.setswitchinterval(SWITCH_INTERVAL_S)  # side-channel answers wait on the GIL otherwise
        tensors = {name: kv for name, kv in kv_caches.items() if name not in state_layers}
        if not tensors:
            raise LayoutError("no attention KV tensors to register: p2pkv moves SSM state inside attention pages only")
        first = next(iter(tensors.values()))
        mem_type = "VRAM" if first.is_cuda else "DRAM"
        if self.config.verify_kv and self.role != "prefill":  # this release digests host memory only
            check_host(first.device.type)
        device_id = (first.device.index or 0) if first.is_cuda else 0
        self.layout = describe_torch_kv_caches(tensors, num_blocks)
        states = [tensor_info(name, view) for name, kv in kv_caches.items() if name in state_layers
                  for view in (kv if isinstance(kv, list | tuple) else [kv])]
        check_state_views(self.layout, states)
        cpus = parse_cpus(self.config.transfer_cpus)
        with pinned(cpus):  # NIXL's thread pool starts here: on the transfer cores
            self.agent = NixlTransferAgent(unique_agent_name(self.engine_id, self.rank), self.config.nixl_backends,
                                           NIXL_PROGRESS_THREAD, nixl_threads(cpus),
                                           split_bytes=int(READ_SPLIT_MIB * 2**20))
        self.agent.register(self.layout.regions, mem_type, device_id)
        self.agent.set_auto_push(self.config.transfer_mode == "auto")
        m = self.model
        attn = attn_layout_of(first, m.num_kv_heads, m.block_size, m.kv_layout, m.attn_layout)
        self.desc = layout_desc(self.layout, m, attn, mem_type=mem_type, device_id=device_id)
        if self.pp_size > 1:  # a stage's layers: where they start in the model
            self.desc = stage_desc(self.desc, list(tensors), bool(states))
        stager = self._stager = Stager(self.agent, tensors, self.layout, self.desc,
                                       int(self.config.staging_mib * 2**20))
        if self.role != "prefill":  # a prefill rank loads nothing
            groups = groups_by_layer(layer_indices(tensors), layer_groups or {}, state_groups)
            rank = LocalRank(self.engine_id, self.tp_rank, self.tp_size, self.layout, self.desc, device_id, groups)
            self.receiver = Receiver(rank, self.config, self.agent, stager, self.compat_hash, self.stats, m,
                                     secret=self._secret)
            self.receiver.pushes.make_info = self._agent_info
        self.agent.on_transport = self._on_transport
        self.agent.on_peer_removed = self._on_peer_removed
        info = self._agent_info()
        secret = self._secret
        if secret is None:
            logger.warning("p2pkv: side channel on %s:%d runs WITHOUT a secret (insecure=true): anyone who "
                           "reaches it can read this engine's KV cache", self.host, self.port)
        if self.role == "decode":
            self.server = HandshakeServer(self.host, self.port, self.compat_hash, secret=secret,
                                          on_heartbeat=self.holds.on_heartbeat, on_release=self.holds.on_release,
                                          stall_s=SIDE_CHANNEL_STALL_S)
        else:
            self._start_prefill_side(tensors, mem_type, device_id, layer_groups, state_groups)
        self.server.set_info(info)
        self.server.start()
        logger.info("p2pkv: rank %d registered %d %s region(s), %d segment(s) per block (%s, %s pages), "
                    "%d B per block; side channel on %s:%d", self.tp_rank, len(self.layout.regions), mem_type,
                    len(self.layout.segments), "cross-layer" if self.layout.cross_layer else "per-layer", attn,
                    self.layout.block_bytes, self.host, self.server.port)

    def _start_prefill_side(self, tensors: dict[str, Any], mem_type: str, device_id: int,
                            layer_groups: dict[str, int] | None, state_groups: frozenset[int]) -> None:
        """The parts a rank that holds blocks for decode engines uses: the :class:`WriteEngine` (one thread for
        every WRITE) with its two sources, the :class:`Pusher` (push WRITEs) and the :class:`PrefillStreams`
        (layer streams), and the side channel that hands them their requests."""
        assert self.agent is not None and self.desc is not None and self.layout is not None
        secret = self._secret
        cpus = parse_cpus(self.config.transfer_cpus)
        self.writes = WriteEngine(self.agent, secret, faults=load_faults(),
                                  on_start=lambda: start_transfer_thread(mem_type, device_id, cpus))
        device = "cuda" if mem_type == "VRAM" else "cpu"
        self.pusher = Pusher(self.writes, self.holds, self.layout, device=device)
        digests = HoldDigests(self.holds, self.layout, device)  # verified KV: pull's digests
        stage = StageLayers(self.pp_rank, self.desc.first_layer, self.desc.num_layers) if self.pp_size > 1 else None
        self.streams = rank_streams(self.engine_id, self.config, secret, self.writes, self.holds, self.desc, tensors,
                                    on_gpu=mem_type == "VRAM", layer_groups=layer_groups, state_groups=state_groups,
                                    stage=stage, pp_size=self.pp_size)
        self.server = HandshakeServer(self.host, self.port, self.compat_hash, secret=secret,
                                      on_release=self.streams.on_release, stall_s=SIDE_CHANNEL_STALL_S,
                                      on_digest=digests.on_digest, **way_handlers(self.pusher, self.streams))

    def _agent_info(self) -> AgentInfo:
        """This rank's :class:`AgentInfo`: NIXL metadata of everything registered now, the KV layout, and the
        staging area once registered (where a prefill rank may WRITE besides the KV cache)."""
        assert self.agent is not None and self.desc is not None
        meta = self.agent.metadata()
        staging = self._stager.regions() if self._stager is not None else []
        return AgentInfo(engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
                         agent_name=self.agent.name, agent_metadata=meta, metadata_digest=compute_digest(meta),
                         compat_hash=self.compat_hash, layout=self.desc, staging=staging, pp_rank=self.pp_rank,
                         pp_size=self.pp_size)

    def _on_transport(self, report: TransportReport) -> None:
        """UCX said how a peer's READs move: counted, and (``transfer_mode: auto``) the peer's direction.
        (A WRITE's report, this rank pushing as a prefill rank, is logged by the agent only.)"""
        if report.op != "READ":
            return
        self.stats.record_transport(report.mem_type, report.transport)
        if self.receiver is not None:
            self.receiver.directions.on_transport(report)

    def _on_peer_removed(self, agent_name: str) -> None:
        """A remote agent left NIXL: the decode side forgets its direction and probe (any thread)."""
        if self.receiver is not None:
            self.receiver.directions.forget(agent_name)
            if self.receiver.probe is not None:
                self.receiver.probe.forget(agent_name)

    def start_load_kv(self, meta: P2pKvMetadata) -> None:
        """Take this step's new leases (prefill side) and pulls (decode side)."""
        self._idle = meta.idle
        for request_id, deadline in meta.send_leases.items():
            self.holds.hold(request_id, deadline, meta.send_blocks.get(request_id))
        self.hold_traces.began(meta.send_traces, meta.send_blocks)
        if self.streams is not None:
            self.streams.begin_step(meta)
        if self.receiver is not None:
            self.receiver.start(meta.loads, meta.failed, meta.ended_streams)

    def save_kv_layer(self, layer_name: str, meta: P2pKvMetadata) -> None:
        """Layer ``layer_name``'s forward is done in the step ``meta`` describes (streamed requests WRITE it)."""
        if self.streams is not None:
            self.streams.save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        """The step's forward is done (streams whose prompt it finished end)."""
        if self.streams is not None:
            self.streams.end_step()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` request ids since the last call.

        After a step that scheduled no tokens, with nothing to report yet but
        pulls or holds pending, first waits up to :data:`IDLE_WAIT_S` for a pull to
        end (:data:`STREAM_IDLE_WAIT_S` while every pull is a layer stream waiting
        for its prefill); a prefill rank, which loads nothing, sleeps :data:`IDLE_WAIT_S`
        while holds are pending.
        """
        if self.agent is None:
            return set(), set()
        if self.receiver is None:  # a prefill rank: only its holds
            sending = self._released()
            if not sending and self._idle and IDLE_WAIT_S > 0 and self.holds.pending():
                time.sleep(IDLE_WAIT_S)  # vLLM steps an engine with held blocks back to back only to poll them
            return sending, set()
        recving = self._step()
        sending = self._released()
        idle = self._idle and not recving and not sending and self._should_wait()
        wait_s = STREAM_IDLE_WAIT_S if streams_only(self.receiver.transfers) else IDLE_WAIT_S
        if idle and self.receiver.outcomes.wait(wait_s):
            recving = self._step()
        return sending, recving

    def _step(self) -> set[str]:
        """:meth:`Receiver.step`, its exceptions logged: a bug must not end vLLM's engine loop (the pulls it
        touched end by their timeouts)."""
        assert self.receiver is not None
        try:
            return self.receiver.step()
        except Exception:
            logger.exception("p2pkv: advancing the pulls failed")
            return set()

    def _should_wait(self) -> bool:
        """Pulls or holds pending and a wait allowed: the pulls' thread advances pulls meanwhile."""
        assert self.receiver is not None
        if IDLE_WAIT_S <= 0:
            return False
        if self.receiver.busy:
            return self.receiver.progress.threaded  # without the thread, pulls advance only in steps
        return self.holds.pending()

    def _released(self) -> set[str]:
        """Held requests to free now: notified by every decode reader, or lease expired."""
        assert self.agent is not None
        return released_holds(self.agent, self._secret, self.holds, self.streams, self.stats, self.hold_traces)

    def take_stats(self) -> dict | None:
        """Transfer and push statistics since the last call (see :mod:`p2pkv.telemetry.stats`), or None if none."""
        lock = self.receiver.lock if self.receiver is not None else contextlib.nullcontext()
        with lock:  # the pulls' thread records into the buffer too
            if self.pusher is not None:
                now = self.pusher.snapshot()
                self.stats.record_pushes(now, self._pushes_seen)
                self._pushes_seen = now
            if self.streams is not None:
                self.stats.data["stream_tail_seconds"].extend(self.streams.measures.take_tails())
                add_counts(self.stats.data["streams_landed"], self.streams.measures.take_landed())
            return self.stats.take()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose pull failed since the last call.

        Empty where vLLM takes those failures by request (:meth:`take_failed`;
        :attr:`p2pkv.dataplane.negotiate.ModelInfo.load_fails_by_request`: several KV
        cache groups, or an attention window).
        """
        if self.receiver is None:
            return set()
        errors = self.receiver.take_load_errors()
        return set() if self.model.load_fails_by_request else errors

    def take_failed(self) -> set[str]:
        """Request ids whose pull failed, among those :meth:`get_finished` reported since the last call."""
        return self.receiver.take_failed() if self.receiver is not None else set()

    def shutdown(self) -> None:
        """Close the side channel, cancel pulls, drop peers, deregister memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.receiver is not None:
            self.receiver.close()
        if self.server is not None:
            self.server.close()
        if self.writes is not None:  # the pusher's and the streams' WRITE thread: both stop, what is left dropped
            self.writes.close()
        if self.agent is not None:
            self.agent.close()
