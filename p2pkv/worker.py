"""The connector's worker side for one tp_rank: what vLLM calls on each worker process.

Registers the KV memory with NIXL and serves its description on the side
channel; on the decode side hands each step's pulls to
:class:`p2pkv.decode.receiver.Receiver`; on the prefill side holds finished
requests' blocks (:class:`p2pkv.prefill.holds.PrefillHolds`) until every
decode reader has said "done" (:mod:`p2pkv.notification`) or the lease ends,
and WRITEs them into decode ranks that ask (push mode, :class:`p2pkv.prefill.pusher.Pusher`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from handshake import AgentInfo, HandshakeServer, KVLayoutDesc, compute_digest
from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.agent import NixlTransferAgent, unique_agent_name
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
from p2pkv.dataplane.transport import TransportReport
from p2pkv.decode.receiver import Receiver
from p2pkv.decode.transfer import streams_only
from p2pkv.metadata import P2pKvMetadata
from p2pkv.notification import parse_done
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.pusher import Pusher
from p2pkv.prefill.spans import emit_hold_span
from p2pkv.prefill.stream_requests import stream_side
from p2pkv.prefill.streamer import StreamSide
from p2pkv.prefill.streams import PrefillStreams, layer_indices
from p2pkv.telemetry.stats import StatsBuffer, add_counts
from p2pkv.telemetry.tracing import Tracing, traces_endpoint
from p2pkv.transfer_threads import parse_cpus, start_transfer_thread

logger = logging.getLogger("p2pkv.worker")


class WorkerSide:
    """The connector's worker-side half for one tp_rank.

    Args:
        engine_id: this engine's id.
        config: p2pkv settings (a side-channel secret, or ``insecure``).
        tp_rank: this worker's tensor-parallel rank.
        tp_size: this engine's tensor-parallel size.
        side_channel_host: address the side-channel server binds to.
        side_channel_port: this rank's side-channel port.
        compat_hash: the compatibility fingerprint peers must match (:func:`p2pkv.compat.compat_fields`).
        model: this rank's model and KV cache facts.

    Raises:
        p2pkv.config.ConfigError: no side-channel secret and not ``insecure``.
    """

    def __init__(self, engine_id: str, config: P2pKvConfig, tp_rank: int, tp_size: int,
                 side_channel_host: str, side_channel_port: int, compat_hash: str, model: ModelInfo) -> None:
        self.engine_id = engine_id
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.host = side_channel_host
        self.port = side_channel_port
        self.compat_hash = compat_hash
        self.model = model
        self.agent: NixlTransferAgent | None = None
        self.server: HandshakeServer | None = None
        self.layout: KVLayout | None = None
        self.desc: KVLayoutDesc | None = None
        self.receiver: Receiver | None = None
        self.pusher: Pusher | None = None
        self.streams: PrefillStreams | None = None
        self._pushes_seen: dict[str, Any] = {}  # the pusher's counts at the last take_stats
        self._stager: Stager | None = None
        self.holds = PrefillHolds(config.lease_s)
        self._secret = config.require_secret()  # before anything starts: no secret, no side channel
        self.stats = StatsBuffer()
        self._closed = False
        self._idle = False  # this step scheduled no tokens
        self._tracing = Tracing.get("p2pkv-prefill", traces_endpoint(config.otlp_traces_endpoint))
        self._hold_traces: dict[str, tuple[str, int, int]] = {}  # held id → (traceparent, start ns, blocks)

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
            p2pkv.dataplane.layout.LayoutError: a layout p2pkv cannot describe, or state views outside
                the attention pages.
            p2pkv.dataplane.agent.TransferError: NIXL could not register the memory.
        """
        if 0 < self.config.switch_interval_s < sys.getswitchinterval():
            sys.setswitchinterval(self.config.switch_interval_s)  # side-channel answers wait on the GIL otherwise
        tensors = {name: kv for name, kv in kv_caches.items() if name not in state_layers}
        if not tensors:
            raise LayoutError("no attention KV tensors to register: p2pkv moves SSM state inside attention pages only")
        first = next(iter(tensors.values()))
        mem_type = "VRAM" if first.is_cuda else "DRAM"
        device_id = (first.device.index or 0) if first.is_cuda else 0
        self.layout = describe_torch_kv_caches(tensors, num_blocks)
        states = [tensor_info(name, view) for name, kv in kv_caches.items() if name in state_layers
                  for view in (kv if isinstance(kv, list | tuple) else [kv])]
        check_state_views(self.layout, states)
        self.agent = NixlTransferAgent(unique_agent_name(self.engine_id, self.tp_rank), self.config.nixl_backends,
                                       self.config.nixl_progress_thread, self.config.nixl_num_threads,
                                       self.config.backend_params(), self.config.report_transport,
                                       int(self.config.nixl_split_mib * 2**20))
        self.agent.register(self.layout.regions, mem_type, device_id)
        self.agent.set_auto_push(self.config.transfer_mode == "auto")
        m = self.model
        attn = attn_layout_of(first, m.num_kv_heads, m.block_size, m.kv_layout, m.attn_layout)
        self.desc = layout_desc(self.layout, m, attn, mem_type=mem_type, device_id=device_id)
        stager = self._stager = Stager(self.agent, tensors, self.layout, self.desc,
                                       int(self.config.staging_mib * 2**20))
        rank = LocalRank(self.engine_id, self.tp_rank, self.tp_size, self.layout, self.desc, device_id)
        self.receiver = Receiver(rank, self.config, self.agent, stager, self.compat_hash, self.stats, m,
                             secret=self._secret)
        self.agent.on_transport = self._on_transport
        self.agent.on_peer_removed = self._on_peer_removed
        info = self._agent_info()
        self.receiver.pushes.make_info = self._agent_info
        secret = self._secret
        cpus = parse_cpus(self.config.transfer_cpus)
        self.pusher = Pusher(self.agent, self.holds, self.layout, secret,
                             max_in_flight=self.config.push_max_in_flight, max_queued=self.config.push_max_queued,
                             max_agents=self.config.push_max_agents, agent_idle_s=self.config.push_agent_idle_s,
                             poll_interval_s=self.config.pull_poll_interval_s or 0.0002,
                             on_start=lambda: start_transfer_thread(mem_type, device_id, cpus))
        try:
            source: StreamSide | str = stream_side(self.desc)
        except LayoutError as exc:
            source = f"this rank's KV layout cannot be streamed layer by layer ({exc}); send without a grant (push)"
        self.streams = PrefillStreams(self.engine_id, self.agent, self.holds, self.pusher, source,
                                      layer_indices(tensors), secret, on_gpu=mem_type == "VRAM",
                                      min_tokens=self.config.stream_min_tokens,
                                      min_link_share=self.config.stream_min_link_share,
                                      group_of=layer_groups, state_groups=state_groups,
                                      on_start=lambda: start_transfer_thread(mem_type, device_id, cpus),
                                      max_lifetime_s=self.config.max_lifetime_s)
        if secret is None:
            logger.warning("p2pkv: side channel on %s:%d runs WITHOUT a secret (insecure=true): anyone who "
                           "reaches it can read this engine's KV cache", self.host, self.port)
        self.server = HandshakeServer(self.host, self.port, self.compat_hash, secret=secret,
                                      on_heartbeat=self.streams.on_heartbeat, on_release=self.streams.on_release,
                                      on_push=self.pusher.on_push, on_stream=self.streams.on_stream,
                                      future_skew_s=self.config.max_clock_skew_s,
                                      max_connections=self.config.side_channel_max_connections,
                                      max_handshakes=self.config.side_channel_max_handshakes,
                                      stall_s=self.config.side_channel_stall_s)
        self.server.set_info(info)
        self.server.start()
        logger.info("p2pkv: rank %d registered %d %s region(s), %d segment(s) per block (%s, %s pages), "
                    "%d B per block; side channel on %s:%d", self.tp_rank, len(self.layout.regions), mem_type,
                    len(self.layout.segments), "cross-layer" if self.layout.cross_layer else "per-layer", attn,
                    self.layout.block_bytes, self.host, self.server.port)

    def _agent_info(self) -> AgentInfo:
        """This rank's :class:`AgentInfo`: NIXL metadata of everything registered now, the KV layout, and the
        staging area once registered (where a prefill rank may WRITE besides the KV cache)."""
        assert self.agent is not None and self.desc is not None
        meta = self.agent.metadata()
        staging = self._stager.regions() if self._stager is not None else []
        return AgentInfo(engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
                         agent_name=self.agent.name, agent_metadata=meta, metadata_digest=compute_digest(meta),
                         compat_hash=self.compat_hash, layout=self.desc, staging=staging)

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
        if self._tracing is not None:
            for rid, (trace, start_ns) in meta.send_traces.items():
                self._hold_traces[rid] = (trace, start_ns, len(meta.send_blocks.get(rid, ())))
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
        pulls or holds pending, first waits up to ``idle_wait_s`` for a pull to
        end (``stream_idle_wait_s`` while every pull is a layer stream waiting
        for its prefill; see :class:`p2pkv.config.P2pKvConfig`).
        """
        if self.agent is None or self.receiver is None:
            return set(), set()
        recving = self._step()
        sending = self._released()
        idle = self._idle and not recving and not sending and self._should_wait()
        wait_s = self.config.stream_idle_wait_s if streams_only(self.receiver.transfers) else self.config.idle_wait_s
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
        if self.config.idle_wait_s <= 0:
            return False
        if self.receiver.busy:
            return self.config.pull_poll_interval_s > 0  # without the thread, pulls advance only in steps
        return self.holds.pending()

    def _released(self) -> set[str]:
        """Held requests to free now: notified by every decode reader, or lease expired."""
        assert self.agent is not None
        try:
            notifs = self.agent.get_notifs()
        except Exception as exc:  # a broken peer must not lose this step's results
            logger.warning("p2pkv: reading NIXL notifications failed: %s", exc)
            notifs = []
        notes = [n for n in (parse_done(m, self._secret) for m in notifs) if n is not None]
        if len(notes) < len(notifs):
            logger.warning("p2pkv: %d NIXL notification(s) dropped: not p2pkv \"done\" messages, or their MAC "
                           "is wrong (a decode engine with another secret?)", len(notifs) - len(notes))
        if self.streams is not None:
            self.streams.collect()
        released = self.holds.released(notes, self.stats.data)
        if self.streams is not None and released:
            self.streams.holds_ended(released)
        endings, self.holds.endings = self.holds.endings, {}
        if self._tracing is not None:
            for rid, why in endings.items():
                if (trace := self._hold_traces.pop(rid, None)) is not None:
                    traceparent, start_ns, num_blocks = trace
                    emit_hold_span(self._tracing, rid, traceparent, start_ns, why, self.engine_id, self.tp_rank,
                                   num_blocks)
        return released

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

        Empty with several KV cache groups: block ids are unique only within a
        group there, so vLLM takes those failures by request
        (:meth:`take_failed`) and stops the engine on a block id.
        """
        if self.receiver is None:
            return set()
        errors = self.receiver.take_load_errors()
        return errors if self.model.kv_groups <= 1 else set()

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
        if self.streams is not None:
            self.streams.close()
        if self.pusher is not None:
            self.pusher.close()
        if self.agent is not None:
            self.agent.close()
