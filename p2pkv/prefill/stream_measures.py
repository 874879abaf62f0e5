"""What a prefill rank's streams measure, and the link rule it applies with it: a WRITE per layer, or one WRITE.

Streaming hides a request's transfer behind its prefill's forward, at a
cost: posting a WRITE per layer takes CPU time beside the forward (on a
2-core CPU host, or for the GIL, it slowed the forward by 3-17 %,
docs/streaming.md "What the measurements decide"). Where the link moves a
layer in a small share of the time the forward takes to compute it, there
is next to nothing to hide: one WRITE after the last layer (the bytes of a
push, into the same destination) costs the first token that share of the
prefill and nothing during it. The rule: a request streams layer by layer
when

    link seconds per block of one layer  >=  min_share * forward seconds per block of one layer

and goes as one WRITE after its last layer otherwise. Both speeds are
measured here, per block of one layer, so the ratio does not depend on the
prompt's length:

* the forward, from the times vLLM reports consecutive layers done
  (``save_kv_layer``) in a step that computes streamed blocks: the step's
  seconds per layer divided by the streamed blocks it computes (requests
  that do not stream share the step, so this is the time a layer's WRITE
  has to hide behind, per block);
* the link, per decode rank, from each stream that landed whole: its bytes
  over the seconds it had a WRITE in flight.

Each is an exponentially weighted mean of what was measured. Until both are
known for a decode rank, its requests stream layer by layer: the first
stream to a rank measures its link. On a GPU the forward cannot be measured
this way (``save_kv_layer`` runs when a layer is queued, not when it is
computed), so there every request streams (``min_share`` 0).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from p2pkv.prefill.layer_stream import LayerStream, StreamSide

MIN_LINK_SHARE = 0.1
"""The link rule's threshold: a layer-streamed request streams layer by layer only when its decode rank's link
takes at least this share of the forward's time for a layer (``stream_min_tokens`` 0 turns the rule off). It
lies where streaming's measured cost, 3-17 % of the forward on a 2-core CPU host, and what it hides meet: over
``cma`` a 1k-token prompt's layer moved in about 3 ms against a 150 ms layer forward (share 0.02: one WRITE),
over ``tcp`` limited to 256 Mbit/s in about 260 ms (share 1.7: streamed) (docs/streaming.md, "The link rule")."""

WEIGHT = 0.3
"""Weight of the newest sample in each exponentially weighted mean."""

MAX_RANKS = 1024
"""Decode ranks whose link speed is kept (the least recently measured one is dropped first)."""


def layer_block_bytes(side: StreamSide) -> float:
    """Bytes one block of one layer occupies in ``side``'s pages (K and V together; all of a request's layers
    are this many times the layer count).

    Raises:
        ValueError: ``side`` has no pages.
    """
    if not side.pages:
        raise ValueError("a stream side without pages has no bytes per block")
    layers = {p.layer_start for p in side.pages}
    return sum(p.length for p in side.pages) / len(layers)


class StreamMeasures:
    """One prefill rank's stream measurements: the forward's pace, each decode rank's link, the waits after the
    last layer. Thread-safe (the engine thread measures, the side-channel thread asks :meth:`per_layer`).

    Args:
        min_share: the link rule's threshold (:data:`MIN_LINK_SHARE`: the share of a layer's forward one layer's
            transfer must reach for a WRITE per layer; 0: every request streams layer by layer).
        block_bytes: bytes of one block of one layer (:func:`layer_block_bytes`; 0: no stream side, nothing
            is decided here).
        clock: monotonic seconds.
    """

    def __init__(self, min_share: float, block_bytes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_share = min_share
        self.block_bytes = block_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._layer_times: list[float] = []
        self._forward_s: float | None = None  # forward seconds per block of one layer
        self._link_bps: OrderedDict[str, float] = OrderedDict()  # decode rank → bytes per second
        self._tails: list[float] = []
        self._landed = {"per_layer": 0, "whole": 0}

    def layer_done(self) -> None:
        """vLLM reported a layer of a step with streamed blocks done (engine thread)."""
        self._layer_times.append(self._clock())

    def step_ended(self, blocks: int) -> None:
        """The step whose layers :meth:`layer_done` timed has ended; it computed ``blocks`` streamed blocks (its
        chunks' block counts). A step with fewer than two layers timed measures nothing."""
        times, self._layer_times = self._layer_times, []
        if len(times) < 2 or blocks <= 0:
            return
        sample = (times[-1] - times[0]) / (len(times) - 1) / blocks
        with self._lock:
            self._forward_s = _mean(self._forward_s, sample)

    def ended(self, stream: LayerStream, rank: str) -> None:
        """``stream`` to decode rank ``rank`` (``<engine id>:<tp rank>``) has ended: one that landed whole gives
        its wait after the last layer, how its bytes went (:meth:`take_landed`) and, where it had a WRITE in
        flight, its link's speed."""
        if stream.failure is not None:
            return
        counters = stream.counters
        with self._lock:
            self._landed["whole" if stream.bulk else "per_layer"] += 1
            if (tail := counters.tail_s) is not None:
                self._tails.append(tail)
            if counters.bytes > 0 and counters.busy_s > 0:
                self._link_bps[rank] = _mean(self._link_bps.pop(rank, None), counters.bytes / counters.busy_s)
                while len(self._link_bps) > MAX_RANKS:
                    self._link_bps.popitem(last=False)

    def share(self, rank: str) -> float | None:
        """One layer's link time over its forward time, per block, for decode rank ``rank`` (None: not both
        measured yet)."""
        with self._lock:
            bps = self._link_bps.get(rank)
            forward_s = self._forward_s
        if bps is None or forward_s is None or forward_s <= 0 or self.block_bytes <= 0:
            return None
        return self.block_bytes / bps / forward_s

    def per_layer(self, rank: str) -> bool:
        """Whether a request to decode rank ``rank`` streams layer by layer (True) or goes as one WRITE after its
        last layer (False): the link rule above, True until both speeds are measured."""
        if self.min_share <= 0:
            return True
        share = self.share(rank)
        return share is None or share >= self.min_share

    def take_landed(self) -> dict[str, int]:
        """Streams that landed whole since the last call, by how their bytes went: ``per_layer`` (a WRITE per
        layer) or ``whole`` (one WRITE after the last layer: a short prompt, or the link rule)."""
        with self._lock:
            landed, self._landed = self._landed, {"per_layer": 0, "whole": 0}
        return landed

    def take_tails(self) -> list[float]:
        """The waits after the last layer (seconds, :attr:`p2pkv.prefill.layer_stream.StreamCounters.tail_s`) of the
        streams that landed whole since the last call."""
        with self._lock:
            tails, self._tails = self._tails, []
        return tails


def _mean(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - WEIGHT) * old + WEIGHT * sample


__all__ = ["MAX_RANKS", "WEIGHT", "StreamMeasures", "layer_block_bytes"]
