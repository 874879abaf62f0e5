"""Layer-streamed transfer on a prefill rank: the streamed requests, their decode ranks' destinations, their holds.

The pieces meet here (docs/streaming.md):

* the scheduler's :class:`~p2pkv.metadata.StreamChunk` of each step
  (:mod:`p2pkv.scheduling.stream_steps`) open a request's
  :class:`~p2pkv.prefill.layer_stream.LayerStream` and say which blocks the step
  computes (:meth:`PrefillStreams.begin_step`);
* after each attention layer vLLM calls ``save_kv_layer``: the layer's pages
  of those blocks are queued on the :class:`~p2pkv.prefill.poster.StreamPoster`
  (:meth:`PrefillStreams.save_layer`; on a GPU behind a CUDA event recorded
  after the layer, so the forward never waits), and at ``wait_for_save`` a
  request whose prompt the step finished is told so (:meth:`PrefillStreams.end_step`);
* a decode rank's :class:`handshake.StreamRequest` brings its destination
  (:meth:`PrefillStreams.on_stream`, side-channel thread), before or after
  the request is known here.

A stream request is checked by :func:`p2pkv.prefill.stream_requests.check_stream_request`,
then here: the stream id has not had a destination from that decode rank
(a grant serves each once), nor all the destinations the first one said
would come (``readers``: a decode engine of a larger TP size has several
ranks read this one, each streamed to on its own, the later ones replayed
the layers already computed), and there is room for one more pending
destination. Then NIXL loads the
decode agent and keeps it until the stream ends. A decode rank that will
load nothing of a stream (its prefix cache holds the prompt, or the request
ended or failed first) declines it with a release of the stream id and no
block ids (:meth:`PrefillStreams.on_release`): the stream stops and its hold
is freed at once, not at the lease; the same release from the rank that
gave a stream its destination stops that stream mid-way (the decode
request was aborted, or its load failed).

Holds: a streamed request's hold (made when it finishes, whatever its end:
:meth:`p2pkv.scheduling.hold_scheduling.PrefillScheduling.request_finished`) is
pinned once the stream has a destination, so nothing frees the blocks while
a WRITE may read them, and released as soon as its streams have ended and
every destination expected came (or one failed). A stream whose
destination never comes ends with its hold's lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from p2pkv.dataplane.stages import StageLayers
from p2pkv.metadata import P2pKvMetadata, StreamChunk
from p2pkv.prefill.agents import rank_name
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.layer_stream import LayerStream, StreamSide, group_range
from p2pkv.prefill.poster import StreamPoster
from p2pkv.prefill.stream_admits import StreamAdmits
from p2pkv.prefill.stream_destinations import LiveRequest, StreamDestinations
from p2pkv.prefill.stream_ledger import StreamLedger
from p2pkv.prefill.stream_measures import StreamMeasures, layer_block_bytes
from p2pkv.prefill.stream_pending import Destination, PendingDestinations
from p2pkv.prefill.stream_releases import StreamReleases
from p2pkv.prefill.write_engine import WriteEngine

logger = logging.getLogger("p2pkv.prefill")

class PrefillStreams(StreamDestinations, StreamReleases):
    """Every layer-streamed request of one prefill rank (its side channel's destinations:
    :class:`~p2pkv.prefill.stream_destinations.StreamDestinations`; releases and hold questions:
    :class:`~p2pkv.prefill.stream_releases.StreamReleases`).

    Args:
        engine_id: this engine's id (grants must name it).
        engine: this rank's WRITE engine: its NIXL agent (WRITEs, notifications), its decode agents
            (:meth:`p2pkv.prefill.write_engine.WriteEngine.hold_agent`) and its thread, where the streams run.
        holds: this rank's holds (pinned while a stream may WRITE from them).
        source: this rank's pages, or why it cannot stream (an interleaved layout).
        layer_of: vLLM layer name → its layer index in ``source``'s pages (attention layers: those that call
            ``save_kv_layer``).
        group_of: vLLM layer name → its KV cache group (None: every layer in group 0).
        state_groups: the indices of the KV cache groups that hold Mamba/SSM state: their blocks go after the
            prompt's last step, in every layer's pages (a state page lies in the attention tensors').
        secret: checks grants, signs notifications (None: nothing streams).
        on_gpu: the cache is in GPU memory (a layer is WRITTEN once a CUDA event recorded after it completes).
        min_tokens: a request whose decode engine loads fewer prompt tokens goes as one WRITE after its last
            layer (``stream_min_tokens``; 0: every one streams layer by layer; -1: :func:`measured_min_tokens`).
        min_link_share: the link rule's threshold (:data:`p2pkv.prefill.stream_measures.MIN_LINK_SHARE`,
            :class:`p2pkv.prefill.stream_measures.StreamMeasures`; 0: every request streams layer by layer).
        clock: monotonic seconds.
        max_lifetime_s: how far past this rank's clock a grant's expiry may lie (seconds;
            :attr:`p2pkv.config.P2pKvConfig.max_lifetime_s`).
        stage: this rank's pipeline stage (None: it holds every layer): its layers stream into the decode
            ranks' matching layers.
        pp_size: the engine's pipeline stages (a grant must name them).
    """

    def __init__(self, engine_id: str, engine: WriteEngine, holds: PrefillHolds,
                 source: StreamSide | str, layer_of: dict[str, int], secret: bytes | None, *, on_gpu: bool = False,
                 min_tokens: int = 0, min_link_share: float = 0.0, group_of: dict[str, int] | None = None,
                 state_groups: frozenset[int] = frozenset(), clock: Callable[[], float] = time.monotonic,
                 max_lifetime_s: float = 480.0, stage: StageLayers | None = None, pp_size: int = 1) -> None:
        self.engine_id = engine_id
        self.engine = engine
        self.agent = engine.agent
        self.holds = holds
        self.source = source
        self.stage = stage
        self.pp_size = pp_size
        self.layer_of = layer_of
        self._secret = secret
        self._on_gpu = on_gpu
        self._min_tokens = min_tokens if min_tokens >= 0 else measured_min_tokens(source)
        self._clock = clock
        block_bytes = layer_block_bytes(source) if isinstance(source, StreamSide) else 0.0
        self.measures = StreamMeasures(0.0 if on_gpu else min_link_share, block_bytes, clock)
        self.poster = StreamPoster(engine)
        self._lock = threading.Lock()
        self._live: dict[str, LiveRequest] = {}  # prefill request id → its stream
        self._by_stream: dict[str, str] = {}  # stream id → prefill request id
        self._pending = PendingDestinations()  # destinations whose request is not known yet
        self._ledger = StreamLedger(clock)  # stream ids served, declined or stopped
        self._ended_early: dict[str, float] = {}  # request id → when its stream ended before its hold was known
        self.max_lifetime_s = max_lifetime_s
        self._admits = StreamAdmits(clock, max_lifetime_s, self._ledger, self._pending, self._tell)
        self._step: list[StreamChunk] = []
        self._prepared: P2pKvMetadata | None = None  # the step whose chunks were taken
        self.group_of = group_of or {}
        self.state_groups = state_groups
        self.kv_groups = max([0, *self.group_of.values(), *state_groups]) + 1
        self._seen: set[tuple[int, int]] = set()  # (layer, group) vLLM reported done this step
        self._layers = {(layer, self.group_of.get(name, 0)) for name, layer in layer_of.items()}

    # ---- engine thread -------------------------------------------------------------------
    def begin_step(self, meta: P2pKvMetadata) -> None:
        """This step's holds just made (``meta.send_leases``, already given to :attr:`holds`), and its chunks
        and aborts if the forward has not taken them yet (vLLM calls ``start_load_kv`` after the forward)."""
        self.prepare(meta)
        with self._lock:
            for request_id in meta.send_leases:
                self._on_hold(request_id, meta.send_blocks.get(request_id, ()))

    def prepare(self, meta: P2pKvMetadata) -> None:
        """Take this step's stream aborts and chunks, once per step (from the first layer's ``save_kv_layer``,
        or ``start_load_kv``): streams open, and their destinations if these came first."""
        if meta is self._prepared:
            return
        self._prepared = meta
        with self._lock:
            for request_id, (stream_id, expiry) in meta.stream_admits.items():
                self._admits.admit(request_id, stream_id, expiry)
            for stream_id, why in meta.stream_refusals.items():
                self._admits.refused(stream_id, why)
            for request_id, why in meta.stream_aborts.items():
                if request_id not in self._live:
                    self._admits.aborted(request_id, why)
        for request_id, why in meta.stream_aborts.items():
            self.poster.abort(request_id, why)
        restarts = list(meta.stream_restarts)
        with self._lock:
            for chunk in meta.streams:
                if chunk.request_id not in self._live:
                    self._open(chunk)
                elif chunk.prompt_digest:  # opened again: resumed after a preemption this rank was not told of
                    # (a vLLM without SchedulerOutput.preempted_req_ids). Only a fallback: a destination that
                    # comes between the preemption and this chunk may be WRITTEN the freed blocks' layers first.
                    restarts.append(chunk.request_id)
        for request_id in dict.fromkeys(restarts):
            self.poster.restart(request_id)
        self._step = [c for c in meta.streams if c.request_id in self._live]
        self._seen = set()

    def _tell(self, dest: Destination, why: str) -> None:
        """A waiting destination gets no stream: its decode rank is told ``why``, its agent released."""
        self.engine.tell_failed(dest.target.agent, dest.target.push_id, why)
        self.engine.release_agent(dest.identity)

    def _open(self, chunk: StreamChunk) -> None:
        """A streamed request's first chunk: its stream, and its destination if it came first. A chunk naming a
        stream id that serves another request here is not streamed (a stream id is never moved to another
        request). Lock held."""
        assert isinstance(self.source, StreamSide)
        if (grant_ends := self._admits.open(chunk.request_id, chunk.stream_id)) is None:
            return
        bulk = chunk.loaded_tokens < self._min_tokens
        stream = LayerStream(chunk.request_id, self.source, self.agent, self._secret, self._clock, bulk=bulk,
                             faults=self.engine.faults)
        self.poster.add(chunk.request_id, stream, keep=True)
        self._live[chunk.request_id] = LiveRequest(chunk.stream_id, chunk.prompt_digest, chunk.loaded_tokens, bulk,
                                             grant_ends=grant_ends)
        self._by_stream[chunk.stream_id] = chunk.request_id
        if self._ledger.take_decline(chunk.stream_id):
            self.poster.abort(chunk.request_id, "the decode engine declined the stream (it loads nothing of it)")
            return
        for dest in self._pending.take(chunk.stream_id):
            if dest.deadline <= self._clock() or self._attach(chunk.request_id, dest)[0] != "accepted":
                self.engine.release_agent(dest.identity)

    def _on_hold(self, request_id: str, blocks: tuple[int, ...]) -> None:
        """A hold was made for ``request_id``: pinned if its stream has a destination, released at once if its
        stream has already ended. Lock held."""
        if self._ended_early.pop(request_id, None) is not None:
            self.holds.on_release([request_id], [list(blocks)])
            return
        live = self._live.get(request_id)
        if live is None:
            return
        live.hold_blocks = blocks
        if live.identity is not None and not live.pinned and live.ended < live.streams:  # a stream may WRITE
            live.pinned = self.holds.pin(request_id, list(blocks)) == "held"

    def save_layer(self, layer_name: str, meta: P2pKvMetadata) -> None:
        """The forward finished layer ``layer_name`` of the step ``meta`` describes: its pages of the step's
        chunks may go."""
        self.prepare(meta)
        if not self._step:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        group = self.group_of.get(layer_name, 0)
        self._seen.add((layer, group))
        self.measures.layer_done()
        ready = self._ready()
        for chunk in self._step:
            first_block, block_ids = chunk_blocks(chunk, group)
            if block_ids:
                self.poster.computed(chunk.request_id, layer, first_block, block_ids, ready, group)

    def _ready(self) -> Callable[[], bool] | None:
        """The ready test of what the forward has written so far (on a GPU, a CUDA event recorded now)."""
        if not self._on_gpu:
            return None
        import torch

        event = torch.cuda.Event()
        event.record()
        return event.query

    def end_step(self) -> None:
        """The step's forward is done: streams whose prompt it finished send their last layers, then end. A step
        in which vLLM did not report every layer done (``save_kv_layer``) stops its streams: a layer not
        WRITTEN must never be announced as landed."""
        missing = self._layers - self._seen
        ready = self._ready() if self.state_groups and any(chunk.last for chunk in self._step) else None
        for chunk in self._step:
            if missing:
                layer, group = min(missing)
                self.poster.abort(chunk.request_id, f"vLLM reported {len(self._seen)} of {len(self._layers)} layers "
                                  f"done in a step (save_kv_layer; first missing: layer {layer} of KV cache "
                                  f"group {group})")
            elif chunk.last:
                for group in sorted(self.state_groups):
                    first_block, block_ids = chunk_blocks(chunk, group)
                    for layer in sorted({layer for layer, _ in self._layers}) if block_ids else ():
                        self.poster.computed(chunk.request_id, layer, first_block, block_ids, ready, group)
                self.poster.finish(chunk.request_id)
        self.measures.step_ended(sum(attention_blocks(chunk, self.kv_groups, self.state_groups)
                                     for chunk in self._step))
        self._step = []

    def collect(self) -> None:
        """Streams that ended: their decode agents released, their holds unpinned and released (or, not made
        yet, released when made), the ids of those stopped before any destination came kept so that a late one is
        refused at once (the decode rank fails its load then, not at its window); destinations whose window
        passed unclaimed dropped; what those that landed measured given to :attr:`measures`.
        Before the holds' ``released``."""
        now = self._clock()
        ended = self.poster.take_ended()
        with self._lock:
            for stream in ended:
                live = self._live.get(stream.request_id)
                if live is None:
                    continue
                live.ended += 1
                live.failed = live.failed or stream.failure
                if (identity := live.agents.get(stream.agent or "")) is not None:
                    self.engine.release_agent(identity)
                    self.measures.ended(stream, rank_name(identity))
                if live.ended == live.streams and live.expects_more() and live.pinned:
                    self.holds.unpin(stream.request_id)  # its hold waits for the rest, or its lease
                    live.pinned = False
                elif live.ended == live.streams:
                    self._end(stream.request_id, live, now)
            self._admits.expire(now)
            unserved = [r for r, live in self._live.items() if live.identity is None and live.grant_ends <= now]
            for request_id in unserved:
                self._live[request_id].grant_ends = float("inf")
            for request_id in [r for r, t in self._ended_early.items() if now - t > self.holds.lease_s]:
                del self._ended_early[request_id]
            self._ledger.expire()
        for request_id in unserved:  # no destination can come any more: its hold ends with the stream
            self.poster.abort(request_id, "no decode rank sent a destination before the stream's grant expired")

    def holds_ended(self, request_ids: set[str]) -> None:
        """These holds ended (a lease ran out before every destination came): their streams stop, and a request
        whose streams have all ended waits for no more destinations."""
        with self._lock:
            waiting = [r for r in request_ids if r in self._live and not self._live[r].pinned]
            for request_id in waiting:
                live = self._live[request_id]
                if live.ended == live.streams:
                    self._end(request_id, live, self._clock())
        for request_id in waiting:
            self.poster.abort(request_id, "the hold ended before the decode rank's destination arrived")

    def _end(self, request_id: str, live: LiveRequest, now: float) -> None:
        """Every stream of ``request_id`` has ended: it is forgotten, a destination still to come refused at once,
        its hold unpinned and released (or, not made yet, released when made). Lock held."""
        del self._live[request_id]
        self._by_stream.pop(live.stream_id, None)
        if live.identity is None or live.expects_more():
            self._ledger.stop(live.stream_id, live.failed or "its request's streams ended before this destination")
        if live.pinned:
            self.holds.unpin(request_id)
        if live.hold_blocks is not None:
            self.holds.on_release([request_id], [list(live.hold_blocks)])
        else:
            self._ended_early[request_id] = now
        self.poster.drop(request_id)

    def close(self) -> None:
        """Close the WRITE engine (streams still running are aborted; push's WRITEs dropped). Idempotent."""
        self.poster.close()


def chunk_blocks(chunk: StreamChunk, group: int) -> tuple[int, Sequence[int]]:
    """``(first_block, block_ids)`` of KV cache group ``group`` in ``chunk`` (none for a group it lacks)."""
    return group_range(chunk.first_block, chunk.block_ids, chunk.group_blocks, group)


def attention_blocks(chunk: StreamChunk, kv_groups: int, state_groups: frozenset[int]) -> int:
    """The blocks a layer computes in ``chunk``'s step: its largest attention group's, of ``kv_groups`` groups (a
    state group's one block, in the last chunk, is no measure of the forward's work)."""
    groups = [g for g in range(kv_groups) if g not in state_groups]
    return max((len(chunk_blocks(chunk, g)[1]) for g in groups), default=0)


MEASURED_MIN_TOKENS = {"per_layer": 128, "cross_layer": 512}
"""The shortest prompt (tokens) from which on a WRITE per layer beat one WRITE after the last layer, by cache
kind, on UCX's ``cma`` and ``tcp`` alike (docs/benchmarks/stream-threshold-cpu.md: a stand-in forward of 2 µs per
token and layer; below it the WRITEs' overhead outweighs what streaming hides)."""


def measured_min_tokens(source: StreamSide | str) -> int:
    """:data:`MEASURED_MIN_TOKENS` for ``source``'s cache kind: cross-layer when a page's block stride spans more
    than two pages (other layers' pages lie between a layer's blocks; K and V side by side span two)."""
    if isinstance(source, str):
        return 0
    cross = any(p.block_stride > 2 * p.length for p in source.pages)
    return MEASURED_MIN_TOKENS["cross_layer" if cross else "per_layer"]


def layer_indices(kv_caches: dict[str, object]) -> dict[str, int]:
    """vLLM layer name → layer index, as :func:`p2pkv.dataplane.layout.describe_torch_kv_caches` numbers the
    layers (the order of ``kv_caches``, a tensor shared by several layers counted once).

    Args:
        kv_caches: layer name → its KV tensor (``data_ptr()`` and ``shape``).
    """
    index: dict[tuple[int, tuple[int, ...]], int] = {}
    out = {}
    for name, tensor in kv_caches.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))  # type: ignore[attr-defined]
        out[name] = index.setdefault(key, len(index))
    return out


__all__ = ["MEASURED_MIN_TOKENS", "PrefillStreams", "attention_blocks", "chunk_blocks", "layer_indices",
           "measured_min_tokens"]
