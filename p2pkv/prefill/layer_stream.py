"""Layer-streamed transfer on a prefill rank: WRITE each layer's KV of a request while the prefill still runs.

One :class:`LayerStream` per request and decode rank. The prefill tells it,
after each attention layer, which of the prompt's blocks that layer has
computed (:meth:`LayerStream.computed`; on a GPU with a ``ready`` test, for
example ``torch.cuda.Event.query`` of an event recorded after the layer, so
the forward never waits for a transfer). Once the decode rank's destination
is known (:meth:`LayerStream.target`), :meth:`LayerStream.pump` WRITEs every
computed layer whose ``ready`` holds: layers computed before the destination
arrived go at once, in one WRITE, and the rest one WRITE per layer as they
come. After :meth:`LayerStream.finish` (no layer left to compute) and every
WRITE's end, the decode rank gets one "pushed" notification
(:class:`p2pkv.notification.PushedNotification`) naming the stream's
``push_id``: attached to the last WRITE when nothing else is in flight (NIXL
delivers it after that WRITE's bytes, and the earlier WRITEs have ended),
sent on its own otherwise. A failed WRITE, or :meth:`LayerStream.abort`,
stops the stream: WRITEs in flight are cancelled, and once no WRITE NIXL
refused to cancel can still write, the decode rank is told ``ok=False``
with the reason (it hands its blocks back to vLLM on that word, so the word
never comes before the last byte) and the stream has :attr:`LayerStream.ended`
(the caller keeps the source blocks until then). A destination's
``deadline`` (the decode rank's window: it gives the load up then) stops the
stream the same way when it passes first, whatever is in flight: the last
WRITE too, which carries the notification (cancelled; one NIXL would not
cancel is waited out before the word), so no WRITE of a stream is posted or
left running past its window.

A chunk ending inside a block sends that block; the next chunk sends it
again whole, which rewrites the earlier tokens with the same bytes. So that
an older WRITE never lands over a newer one, a layer's chunk waits while a
WRITE holding that layer is in flight.

Not thread-safe: one thread calls every method of a stream (the caller
queues the forward's calls to it), and keeps progressing the agent after
the stream has ended, as NIXL sends a notification while its worker
progresses. The decode rank's destination must have
been checked by the caller, as a push request's rows are: its agent loaded
under that decode rank's own name, every target page inside the regions that
agent registered.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from handshake import GroupBlocks
from p2pkv.dataplane.agent import TransferError
from p2pkv.dataplane.digest import combine, page_block_digest
from p2pkv.dataplane.layers import LayerRows, layer_rows
from p2pkv.dataplane.plan import PlanError, check_block_ids
from p2pkv.notification import PushedNotification, encode_pushed
from p2pkv.prefill.write_engine import past_window

if TYPE_CHECKING:
    from p2pkv.dataplane.agent import XferHandle
    from p2pkv.dataplane.layout import Segment
    from p2pkv.faults import Faults

logger = logging.getLogger(__name__)


class Writer(Protocol):
    """What a stream needs of :class:`p2pkv.dataplane.agent.NixlTransferAgent`."""

    def start_write(self, peer: str, local_descs: np.ndarray, remote_descs: np.ndarray,
                    notif: bytes) -> XferHandle: ...

    def poll(self, xfer: XferHandle) -> bool: ...

    def cancel(self, xfer: XferHandle) -> bool: ...

    def send_notif(self, peer: str, msg: bytes) -> None: ...


class StreamState(str, enum.Enum):
    """Where a :class:`LayerStream` is."""

    WAITING = "waiting"
    """The decode rank's destination is not known yet; computed layers wait."""
    STREAMING = "streaming"
    """Layers are WRITTEN as they are computed."""
    ENDED = "ended"
    """Nothing more is posted: done, or stopped (see :attr:`LayerStream.ended` for when it may be dropped)."""


@dataclass(frozen=True)
class StreamSide:
    """One rank's KV memory as a stream moves it.

    Attributes:
        pages: the rank's :func:`p2pkv.dataplane.layers.page_segments`.
        num_blocks: blocks in the rank's cache (every block id below it).
        device_id: the rank's device id in its rows.
        segments: the segments the pages were cut from (one per region, whole blocks), where known: a
            staging destination in this rank's geometry mirrors them
            (:func:`p2pkv.prefill.stream_requests.staging_side`).
        geometry: what must match besides the pages' sizes and order for a stream to move them as they are:
            ``(attn_layout, dtype, num_kv_heads, head_dim, block_size, is_mla)``; empty: not compared.
    """

    pages: tuple[Segment, ...]
    num_blocks: int
    device_id: int = 0
    segments: tuple[Segment, ...] = ()
    geometry: tuple[object, ...] = ()


@dataclass(frozen=True)
class StreamTarget:
    """Where a decode rank wants the request's KV: its blocks for a range of the prompt's blocks.

    Attributes:
        agent: the decode rank's NIXL agent name (loaded by the caller).
        side: the decode rank's memory.
        block_ids: decode block ids for prompt blocks ``first_block ..``, int.
        first_block: the prompt block index of ``block_ids[0]`` (blocks the decode
            engine has cached itself come before it and are not sent).
        push_id: names the stream in its "pushed" notification (16–32 bytes).
        deadline: when the decode rank gives the load up (its window; seconds on the stream's ``clock``):
            nothing is posted from then on (the stream stops as by :meth:`LayerStream.abort`).
        whole: every layer goes in one WRITE after the last (the link is fast against the forward:
            :meth:`p2pkv.prefill.stream_measures.StreamMeasures.per_layer`), as for a ``bulk`` stream.
        group_blocks: a model with several KV cache groups: the decode blocks of groups 1 .. (``block_ids``
            and ``first_block`` are group 0's); a layer's pages of group ``g``'s blocks go to group ``g``'s.
        source_pages: the pages of the stream's :class:`StreamSide` this destination takes, in its order (a slice
            of heads of each: :func:`p2pkv.prefill.stream_requests.slice_sides`); empty: the pages whole.
        digest: verified KV: the final word carries the digest of what the stream WROTE, each page of each
            destination block digested from this rank's memory as its WRITE is posted
            (:func:`p2pkv.dataplane.digest.combine`, keyed by page, KV cache group and block).
    """

    agent: str
    side: StreamSide
    block_ids: tuple[int, ...]
    first_block: int
    push_id: bytes
    deadline: float = math.inf
    whole: bool = False
    group_blocks: tuple[GroupBlocks, ...] = ()
    source_pages: tuple[Segment, ...] = ()
    digest: bool = False

    def blocks(self, group: int) -> tuple[int, Sequence[int]]:
        """``(first_block, block_ids)`` of KV cache group ``group`` (no blocks for a group it does not name)."""
        return group_range(self.first_block, self.block_ids, self.group_blocks, group)


def group_range(first_block: int, block_ids: Sequence[int], group_blocks: Sequence[GroupBlocks],
                group: int) -> tuple[int, Sequence[int]]:
    """``(first_block, block_ids)`` of KV cache group ``group`` where group 0's are ``first_block`` and
    ``block_ids`` and groups 1 .. are ``group_blocks`` (no blocks for a group beyond them)."""
    if group == 0:
        return first_block, block_ids
    if group - 1 < len(group_blocks):
        named = group_blocks[group - 1]
        return named.first_block, named.block_ids
    return 0, ()


@dataclass
class _Chunk:
    """Blocks ``first_block ..`` of KV cache group ``group`` in one layer's pages, computed (once ``ready``
    holds) into ``source_ids``."""

    layer: int
    first_block: int
    source_ids: tuple[int, ...]
    ready: Callable[[], bool] | None
    group: int = 0


@dataclass
class StreamCounters:
    """What one stream did (seconds on its clock; None until it happened).

    Attributes:
        finished: :meth:`LayerStream.finish` (the forward reported its last layer).
        last_ready: its last layer's values seen in memory (its ready test passed, or
            posted without one), at most a poll after they were.
        notified: the decode rank told (its final WRITE seen done, or the word sent alone).
        busy_s: seconds some WRITE of the stream was in flight (from a post while none was, to the poll that saw
            the last one done): with :attr:`bytes`, the link's speed as the stream saw it.
        busy_since: when the WRITEs in flight began to be (None: none is).
    """

    writes: int = 0
    bytes: int = 0
    descriptors: int = 0
    first_post: float | None = None
    last_post: float | None = None
    finished: float | None = None
    last_ready: float | None = None
    notified: float | None = None
    layers_posted: list[int] = field(default_factory=list)
    busy_s: float = 0.0
    busy_since: float | None = None

    @property
    def tail_s(self) -> float | None:
        """Seconds from the prefill's last layer computed (the later of :attr:`finished` and :attr:`last_ready`)
        to the decode rank told: the wait after the last layer a stream adds to the first token (None until
        both are known)."""
        if self.finished is None or self.notified is None:
            return None
        return max(0.0, self.notified - max(self.finished, self.last_ready or self.finished))


@dataclass(eq=False)
class LayerStream:
    """One request's layer-streamed WRITEs from this prefill rank into one decode rank.

    Attributes:
        request_id: the prefill request id (log lines).
        source: this rank's memory.
        writer: posts and polls the WRITEs (the rank's NIXL agent).
        secret: signs the "pushed" notification (None: unsigned).
        clock: monotonic seconds (tests pass a fake).
        bulk: post nothing before :meth:`finish`, then every layer in one WRITE (a prompt too short for a WRITE
            per layer to pay: ``stream_min_tokens``); the destination, checks and notification are a stream's.
        faults: the operator's injected faults applied to its WRITEs (the rank's
            :attr:`p2pkv.prefill.write_engine.WriteEngine.faults`; None: none).
        state: where the stream is.
        failure: why it stopped (None: it has not).
        counters: what it did.
        handed_back: its runner has handed it back as ended (:class:`p2pkv.prefill.poster.StreamPoster`).
    """

    request_id: str
    source: StreamSide
    writer: Writer
    secret: bytes | None = None
    clock: Callable[[], float] = time.monotonic
    bulk: bool = False
    faults: Faults | None = None
    state: StreamState = field(default=StreamState.WAITING, init=False)
    failure: str | None = field(default=None, init=False)
    counters: StreamCounters = field(default_factory=StreamCounters, init=False)
    handed_back: bool = field(default=False, init=False)
    _target: StreamTarget | None = field(default=None, init=False, repr=False)
    _pieces: dict[tuple[int, int, int], bytes] = field(default_factory=dict, init=False, repr=False)
    _waiting: list[_Chunk] = field(default_factory=list, init=False, repr=False)
    _inflight: list[tuple[XferHandle, frozenset[tuple[int, int]]]] = field(default_factory=list, init=False,
                                                                            repr=False)
    """Each WRITE in flight with its ``(layer, group)`` pairs."""
    _finished: bool = field(default=False, init=False, repr=False)
    _notify_with_write: bool = field(default=False, init=False, repr=False)
    _failure_note: PushedNotification | None = field(default=None, init=False, repr=False)
    """A stopped stream's word to the decode rank, sent once no WRITE can still write."""

    @property
    def agent(self) -> str | None:
        """The decode agent of its destination (None until it has one)."""
        return self._target.agent if self._target is not None else None

    @property
    def ended(self) -> bool:
        """The decode rank has been told, and no WRITE of this stream can still write."""
        return self.state is StreamState.ENDED and not self._inflight and self._failure_note is None

    @property
    def busy(self) -> bool:
        """Something here changes without a new call: WRITEs in flight, or computed layers a destination is
        known for (their ready tests to watch). A stream waiting for its destination, or a bulk one for its
        :meth:`finish`, is not busy."""
        posting = self._finished or (bool(self._waiting) and not self.bulk)
        return bool(self._inflight) or (self.state is StreamState.STREAMING and posting)

    @property
    def urgent(self) -> bool:
        """Being late costs the stream time: computed layers whose ready tests to watch (or, finished, to post),
        or a finished stream whose notification waits for its WRITEs' end. Otherwise only WRITEs are in flight,
        whose end nothing waits for at once (the notification rides the last one)."""
        if self.state is not StreamState.STREAMING:
            return False
        return (bool(self._waiting) and (self._finished or not self.bulk)) or (
            self._finished and not self._notify_with_write)

    def computed(self, layer: int, first_block: int, source_ids: Sequence[int],
                 ready: Callable[[], bool] | None = None, group: int = 0) -> None:
        """Layer ``layer`` of prompt blocks ``first_block ..`` is computed into this rank's ``source_ids``.

        Args:
            layer: the layer index of the pages (0-based; :func:`p2pkv.prefill.prefill_streams.layer_indices`).
            first_block: the block index of ``source_ids[0]`` (in KV cache group ``group``'s block list).
            source_ids: this rank's block ids, in prompt order.
            ready: True once the layer's values are in memory (None: they are now).
            group: the KV cache group whose blocks these are (0 for a model with one group).
        """
        if self.state is StreamState.ENDED:
            return
        self._waiting.append(_Chunk(layer, first_block, tuple(source_ids), ready, group))

    def target(self, target: StreamTarget) -> None:
        """The decode rank's destination arrived: from the next :meth:`pump` on, computed layers are WRITTEN.

        Raises:
            ValueError: a destination was already given, its pages differ from this rank's (count, size,
                layer or K/V), or a block id lies outside its cache (PlanError).
        """
        if self._target is not None:
            raise ValueError(f"request {self.request_id}: the stream already has a destination")
        ours, theirs = target.source_pages or self.source.pages, target.side.pages
        if [(p.length, p.layer_start, p.kv_index) for p in ours] != [
                (p.length, p.layer_start, p.kv_index) for p in theirs]:
            raise ValueError(f"request {self.request_id}: the destination's {len(theirs)} pages per block differ "
                             f"from this rank's {len(ours)} (page size, layer or K/V); stream only between "
                             "engines with the same block size, page order and heads")
        check_block_ids(target.block_ids, target.side.num_blocks, "decode")
        for named in target.group_blocks:
            check_block_ids(named.block_ids, target.side.num_blocks, "decode")
        self._target = target
        self.bulk = self.bulk or target.whole
        if self.state is StreamState.WAITING:
            self.state = StreamState.STREAMING

    def restart(self) -> None:
        """The request was preempted: vLLM freed its blocks, and computes it again from its first token (the
        layers come again through :meth:`computed`, in the blocks it is given then). The layers computed and not
        WRITTEN yet are dropped: their source blocks may hold another request's KV now. WRITEs in flight are left
        to end; a layer computed again waits for its layer's, so the bytes computed again land last."""
        if self.state is not StreamState.ENDED:
            self._waiting.clear()

    def finish(self) -> None:
        """No layer is left to compute: once every WRITE has ended, the decode rank is told."""
        self._finished = True
        self.counters.finished = self.clock()

    def abort(self, reason: str) -> None:
        """Stop: nothing more is posted, WRITEs in flight are cancelled, the decode rank is told ``reason``."""
        if self.state is not StreamState.ENDED:
            self._fail(reason)

    def pump(self) -> bool:
        """Post what is ready, poll what is in flight, and tell the decode rank when all has landed.

        Any error ends the stream, told to the decode rank (a failed WRITE, a
        ``ready`` test that raised): nothing raises out of here.

        Returns:
            True while the stream has work left (call again), False once it has ended.
        """
        if self.state is StreamState.STREAMING:
            try:
                self._poll()
                if self.state is StreamState.STREAMING and past_window(self._deadline(), self.clock()):
                    self._fail("the decode rank's window passed before the stream ended (it gives the load up "
                               "then: stream_timeout_s on the decode engine)")
                    return not self.ended
                self._post_ready()
                if self._finished and not self._waiting and not self._inflight and not self._notify_with_write:
                    self._notify(self._landed_note())
            except (TransferError, PlanError) as exc:
                self._fail(str(exc))
            except Exception as exc:  # a ready test that raised (a CUDA error): the stream ends, never hangs
                logger.exception("p2pkv: stream of request %s", self.request_id)
                self._fail(f"{type(exc).__name__}: {exc}")
        elif self._inflight:
            self._poll_after_end()
        return not self.ended

    def _post_ready(self) -> None:
        """One WRITE of every waiting chunk whose layer is ready (in order: a chunk not ready, or a WRITE of its
        layer in flight, holds that layer's later chunks back, so a block's older bytes never land last). A bulk
        stream waits for :meth:`finish`."""
        if self.bulk and not self._finished:
            return
        ready: list[_Chunk] = []
        held: set[tuple[int, int]] = {key for _, keys in self._inflight for key in keys}
        for chunk in self._waiting:
            key = (chunk.layer, chunk.group)
            if key in held or (chunk.ready is not None and not chunk.ready()):
                held.add(key)
            else:
                ready.append(chunk)
        if not ready:
            return
        self._waiting = [c for c in self._waiting if c not in ready]
        if self._finished and not self._waiting:
            self.counters.last_ready = self.clock()
        rows = [r for chunk in ready for r in self._rows(chunk)]
        if not rows:
            return
        if self._target.digest:  # verified KV: what these WRITEs read, as they are posted
            for chunk in ready:
                self._digest(chunk)
        source = np.concatenate([r.source for r in rows])
        target = np.concatenate([r.target for r in rows])
        last = self._finished and not self._waiting and not self._inflight
        note = encode_pushed(self._landed_note(), self.secret) if last else b""
        if self.faults is not None:  # an operator's injected fault may drop most of the WRITE
            source, target = self.faults.write_rows(source, target, self.request_id)
        xfer = self.writer.start_write(self._target.agent, source, target, note)
        self._inflight.append((xfer, frozenset((chunk.layer, chunk.group) for chunk in ready)))
        self._notify_with_write = last
        now = self.clock()
        c = self.counters
        c.writes += 1
        c.bytes += xfer.num_bytes
        c.descriptors += int(source.shape[0])
        c.first_post = now if c.first_post is None else c.first_post
        c.busy_since = now if c.busy_since is None else c.busy_since
        c.last_post = now
        c.layers_posted.extend(sorted({chunk.layer for chunk in ready}))

    def _rows(self, chunk: _Chunk) -> list[LayerRows]:
        """The rows of ``chunk`` that fall in the target's blocks (none when it covers none)."""
        t = self._target
        first, block_ids = t.blocks(chunk.group)
        lo = max(chunk.first_block, first)
        hi = min(chunk.first_block + len(chunk.source_ids), first + len(block_ids))
        if lo >= hi:
            return []
        source_ids = chunk.source_ids[lo - chunk.first_block:hi - chunk.first_block]
        target_ids = block_ids[lo - first:hi - first]
        src, dst = self.source, t.side
        pages = t.source_pages or src.pages
        pick = [i for i, p in enumerate(pages) if p.layer_start == chunk.layer]
        return layer_rows([pages[i] for i in pick], [dst.pages[i] for i in pick], source_ids, target_ids,
                          source_num_blocks=src.num_blocks, target_num_blocks=dst.num_blocks,
                          source_device=src.device_id, target_device=dst.device_id)

    def _digest(self, chunk: _Chunk) -> None:
        """Digest each page of each destination block ``chunk`` WRITEs, from this rank's memory (a block sent
        again by a later chunk, filled further, replaces its earlier digest)."""
        t = self._target
        first, block_ids = t.blocks(chunk.group)
        lo = max(chunk.first_block, first)
        hi = min(chunk.first_block + len(chunk.source_ids), first + len(block_ids))
        for i, page in enumerate(t.source_pages or self.source.pages):
            if page.layer_start == chunk.layer:
                for k in range(lo, hi):
                    source = chunk.source_ids[k - chunk.first_block]
                    self._pieces[(i, chunk.group, k - first)] = page_block_digest(page, source)

    def _landed_note(self) -> PushedNotification:
        """The word that every WRITE has landed (with the digest of what they read, when asked)."""
        digest = combine(self._pieces) if self._target.digest else b""
        return PushedNotification(self._target.push_id, True, digest=digest)

    def _poll(self) -> None:
        """Drop the WRITEs that have ended; a failed one is dropped too (NIXL has released it) and raises
        TransferError."""
        for entry in list(self._inflight):
            try:
                done = self.writer.poll(entry[0])
            except TransferError:
                self._inflight.remove(entry)
                raise
            if done:
                self._inflight.remove(entry)
        c = self.counters
        if not self._inflight and c.busy_since is not None:
            c.busy_s += self.clock() - c.busy_since
            c.busy_since = None
        if self._notify_with_write and not self._inflight and not self._waiting:
            self._ended()

    def _deadline(self) -> float:
        return self._target.deadline if self._target is not None else math.inf

    def _poll_after_end(self) -> None:
        """After a failure: wait out the WRITEs NIXL would not cancel (their errors are the failure's), then
        tell the decode rank."""
        still = []
        for xfer, layers in self._inflight:
            try:
                if not self.writer.poll(xfer):
                    still.append((xfer, layers))
            except TransferError:
                pass
        self._inflight = still
        self._tell_failure_once_quiet()

    def _fail(self, reason: str) -> None:
        logger.warning("p2pkv: stream of request %s stopped: %s", self.request_id, reason)
        self.failure = reason
        self._waiting.clear()
        self._inflight = [(x, layers) for x, layers in self._inflight if not self.writer.cancel(x)]
        self.state = StreamState.ENDED
        if self._target is None:
            self._ended()
            return
        self._failure_note = PushedNotification(self._target.push_id, False, reason)
        self._tell_failure_once_quiet()

    def _tell_failure_once_quiet(self) -> None:
        """Send the failure's word once no WRITE of the stream is in flight: the decode rank hands its blocks
        back to vLLM when told, so a WRITE still landing would write into blocks of another request."""
        if self._failure_note is not None and not self._inflight:
            note, self._failure_note = self._failure_note, None
            self._notify(note)

    def _notify(self, note: PushedNotification) -> None:
        """Send the "pushed" notification on its own (failures to send are logged: the decode's window ends it)."""
        try:
            self.writer.send_notif(self._target.agent, encode_pushed(note, self.secret))
        except TransferError as exc:
            logger.warning("p2pkv: stream of request %s: notification not sent: %s", self.request_id, exc)
        self._ended()

    def _ended(self) -> None:
        self.state = StreamState.ENDED
        self.counters.notified = self.clock()
