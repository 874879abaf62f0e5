"""Layer-streamed transfer in ``scripts/bench_transfer.py`` (``--mode stream``): WRITE while the prefill computes.

The prefill process plays a prefill's forward (:class:`Forward`):
``num_layers`` layers of ``--layer-ms`` each (on a GPU a ``torch.cuda._sleep``
kernel per layer on the current stream, an event recorded after it, the host
never waiting; on the CPU the host asleep for that long, as a forward in
torch's kernels leaves the GIL, or busy pumping the stream with ``--poster
inline``), or on a GPU with ``--layer-ms 0`` one
GEMM of a Llama-3-8B layer's FLOPs per layer, with the product's :class:`p2pkv.prefill.layer_stream.LayerStream`
WRITING each layer of the request's blocks into the decode process's once
the layer is done. Two ways per request, each timed the same:

* ``stream``: the decode's destination is known before layer 0, each layer
  is WRITTEN once computed, one "pushed" notification after the last;
* ``bulk``: the layers are computed first, then one WRITE of the request's
  blocks (the rows a push of the same method uses, with its notification):
  today's push, measured the same way.

The decode side asks (a message over the pipe), waits for the "pushed"
notification, and reads the prefill's clock of its last layer's end (the
event seen complete; ``time.monotonic`` is one clock for both processes of a
host): ``wait_after_last_layer_ms`` is the notification's arrival minus
that, what layer streaming exists to shrink; ``total_ms`` the ask to the
arrival. Methods (:data:`STREAM_METHODS`): ``cross_layer`` (``BLHNC`` caches:
each layer's page strides by the whole block, one descriptor per block per
layer) and ``per_layer`` (``LBHNC``: runs of blocks coalesce within a layer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from p2pkv.dataplane.layers import page_segments
from p2pkv.notification import PUSH_PREFIX, PushedNotification, encode_pushed, parse_pushed
from p2pkv.prefill.layer_stream import LayerStream, StreamSide, StreamTarget
from p2pkv.prefill.poster import StreamPoster

if TYPE_CHECKING:
    from p2pkv.dataplane.agent import NixlTransferAgent
    from p2pkv.dataplane.layout import Segment

STREAM_METHODS: dict[str, str] = {
    "cross_layer": "layer-streamed WRITEs between cross-layer caches (BLHNC): one descriptor per block per layer",
    "per_layer": "layer-streamed WRITEs between per-layer caches (LBHNC): one descriptor per run per layer",
}
"""Methods measured in stream mode → what they move."""

WAYS = ("stream", "bulk")
"""Each method's two ways: WRITE each layer once computed, or everything after the last layer."""

FORWARD_STREAMS = ("current", "side")
"""Which CUDA stream the stand-in forward runs on: torch's current one (the legacy default stream unless a
caller set another, as a model runner that sets none), or a side stream of torch's pool (created
non-blocking: work that UCX queues on the legacy default stream does not wait for it)."""

POSTERS = ("thread", "inline")
"""Which thread pumps a stream: a :class:`p2pkv.prefill.poster.StreamPoster`'s own, or the forward's between
layers."""

TIMEOUT_S = 120.0
"""The prefill gives up on a request not ended after this many seconds."""


class Forward:
    """A stand-in for a prefill's forward on ``device``, layer by layer.

    ``layer_ms`` > 0: each layer takes that long. On a GPU it is a
    ``torch.cuda._sleep`` kernel (its cycles per millisecond measured once),
    followed by a recorded event: the host runs ahead and tests the events. On
    the CPU the host itself is busy. ``layer_ms`` 0 on a GPU: each layer is one
    GEMM with a Llama-3-8B layer's weight FLOPs for the request's tokens
    (``tokens x 4096`` by ``4096 x 53248`` in bfloat16, 2 x 218M FLOPs per
    token), so the WRITEs compete with real work for the GPU's memory.
    ``forward_stream`` (:data:`FORWARD_STREAMS`): the CUDA stream the layers
    run on (ignored on the CPU).

    Raises:
        ValueError: ``layer_ms`` 0 on the CPU, or an unknown ``forward_stream``.
    """

    GEMM_COLUMNS = 53248
    """Columns of the stand-in weight: 4096 x 53248 = 218M, a Llama-3-8B layer's weights."""

    def __init__(self, device: str, layer_ms: float, forward_stream: str = "current") -> None:
        import torch

        if forward_stream not in FORWARD_STREAMS:
            raise ValueError(f"--forward-stream {forward_stream}: expected one of {', '.join(FORWARD_STREAMS)}")
        self.cuda = device.startswith("cuda")
        self.stream = torch.cuda.Stream(device) if self.cuda and forward_stream == "side" else None
        self.layer_s = layer_ms / 1e3
        self.cycles = 0
        self.weight = None
        if not self.cuda and layer_ms <= 0:
            raise ValueError("--layer-ms 0 (a GEMM per layer) needs --device cuda")
        if self.cuda and layer_ms > 0:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)  # warm
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self.cycles = int(layer_ms * 10_000_000 / start.elapsed_time(end))
        elif self.cuda:
            self.weight = torch.randn(4096, self.GEMM_COLUMNS, device=device, dtype=torch.bfloat16)
            self.inputs: dict[int, Any] = {}

    def layer(self, busy: Callable[[], Any] | None, tokens: int) -> Any:
        """Compute one layer of ``tokens`` tokens; returns the ``torch.cuda.Event`` recorded after it (None on
        the CPU: done now). On the CPU, ``busy()`` runs in a loop for the layer's time; without it the thread
        sleeps, as a forward in torch's kernels leaves the GIL to other threads."""
        import torch

        if self.cuda:
            with torch.cuda.stream(self.stream or torch.cuda.current_stream()):
                return self._cuda_layer(tokens)
        if busy is None:
            time.sleep(self.layer_s)
            return None
        end = time.monotonic() + self.layer_s
        while time.monotonic() < end:
            busy()
        return None

    def _cuda_layer(self, tokens: int) -> Any:
        """One layer's kernels on the current CUDA stream, and the event recorded after them."""
        import torch

        if self.weight is not None:
            x = self.inputs.get(tokens)
            if x is None:
                x = self.inputs[tokens] = torch.randn(tokens, 4096, device=self.weight.device, dtype=torch.bfloat16)
            torch.matmul(x, self.weight)
        elif self.cycles:
            torch.cuda._sleep(self.cycles)
        event = torch.cuda.Event()
        event.record()
        return event


def run_stream(agent: NixlTransferAgent, own_segments: list[Segment], own_device: int, peer: str,
               peer_segments: list[Segment], peer_device: int, num_blocks: int, page_bytes: int,
               forward: Forward, poster: StreamPoster | None, msg: dict[str, Any]) -> dict[str, Any]:
    """The prefill's end of one request (``msg``: :func:`stream_request`'s, plus ``rows``, a push's local and
    remote rows, for ``bulk``): compute, WRITE, notify; the reply carries its clock (``compute_end``, ``first_post``).

    ``poster``: the stream runs on that :class:`p2pkv.prefill.poster.StreamPoster`'s thread, the forward's
    thread only queues; None: the forward's thread pumps the stream between layers itself.

    Raises:
        ValueError: the request did not end within :data:`TIMEOUT_S`.
    """
    src = [int(b) for b in msg["prefill_ids"]]
    key = f"bench-{msg['id']}"
    push_id = f"bench-stream-{int(msg['id']):011d}".encode()
    stream = LayerStream(key, StreamSide(tuple(page_segments(own_segments, page_bytes)), num_blocks, own_device),
                         agent)
    target = StreamTarget(peer, StreamSide(tuple(page_segments(peer_segments, page_bytes)), num_blocks, peer_device),
                          tuple(msg["decode_ids"]), 0, push_id)
    streaming = msg["way"] == "stream"
    if streaming:
        if poster is None:
            stream.target(target)
        else:
            poster.add(key, stream)
            poster.target(key, target)
    inline = streaming and poster is None
    t0 = time.monotonic()
    event = None
    for layer in range(int(msg["num_layers"])):
        event = forward.layer(stream.pump if inline else None, int(msg["tokens"]))
        ready = None if event is None else event.query
        if inline:
            stream.computed(layer, 0, src, ready)
            stream.pump()
        elif streaming:
            poster.computed(key, layer, 0, src, ready)
    if event is not None and inline:
        while not event.query():
            stream.pump()
    elif event is not None:
        event.synchronize()  # leaves the GIL to the poster's thread, as a forward waiting on its GPU does
    compute_end = time.monotonic()
    if inline:
        stream.finish()
        while stream.pump():
            _check_time(t0)
    elif streaming:
        poster.finish(key)
        while not stream.ended:
            _check_time(t0)
            time.sleep(0.0001)
    else:
        local, remote = msg["rows"]
        handle = agent.start_write(peer, local, remote, encode_pushed(PushedNotification(push_id, True)))
        while not agent.poll(handle):
            _check_time(t0)
    if poster is None:
        end = time.monotonic() + 0.05
        while time.monotonic() < end:  # NIXL sends the notification while the worker progresses
            agent.progress()
    c = stream.counters
    return {"op": "streamed", "id": msg["id"], "compute_start": t0, "compute_end": compute_end,
            "first_post": c.first_post, "writes": c.writes if streaming else 1,
            "descs": c.descriptors if streaming else int(msg["rows"][0].shape[0]), "failure": stream.failure}


def _check_time(t0: float) -> None:
    if time.monotonic() - t0 > TIMEOUT_S:
        raise ValueError(f"a streamed request did not end within {TIMEOUT_S:g} s")


def timed_stream(link: Any, agent: NixlTransferAgent, msg: dict[str, Any], timeout_s: float) -> dict[str, float]:
    """The decode's end of one request: ask, wait for the "pushed" notification, read the prefill's clock.

    Returns:
        ``total_s`` (ask → notification), ``wait_s`` (the prefill's last layer's end → notification),
        ``compute_s`` (the prefill's layers), ``writes``, ``descs``.

    Raises:
        RuntimeError: the prefill failed, a WRITE failed, or no notification came within ``timeout_s``.
    """
    push_id = f"bench-stream-{int(msg['id']):011d}".encode()
    t0 = time.monotonic()
    link.send(msg)
    note = None
    while note is None:
        for raw in agent.take_notifs(PUSH_PREFIX):
            got = parse_pushed(raw)
            if got is not None and got.push_id == push_id:
                note = got
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"stream request {msg['id']}: no notification within {timeout_s:g} s")
    arrived = time.monotonic()
    reply = link.receive(timeout_s)
    if reply.get("op") != "streamed" or not note.ok:
        raise RuntimeError(f"stream request {msg['id']} failed: {reply.get('error') or note.reason}")
    return {"total_s": arrived - t0, "wait_s": arrived - reply["compute_end"],
            "compute_s": reply["compute_end"] - reply["compute_start"], "writes": reply["writes"],
            "descs": reply["descs"]}


def stream_request(method: str, way: str, req: int, num_layers: int, tokens: int, page_bytes: int, layer_ms: float,
                   device: str, poster: str, forward_stream: str, loc: np.ndarray,
                   rem: np.ndarray) -> dict[str, Any]:
    """The message asking the prefill for one request ``req`` of ``tokens`` tokens: decode blocks ``loc`` from
    prefill blocks ``rem``, ``way`` (:data:`WAYS`) by ``method`` (:data:`STREAM_METHODS`), a forward of
    ``num_layers`` layers (:class:`Forward` of ``layer_ms``) on ``device`` (the prefill's torch device), pages of
    ``page_bytes``; ``poster`` (:data:`POSTERS`) says which thread pumps the stream, ``forward_stream``
    (:data:`FORWARD_STREAMS`) which CUDA stream the forward runs on."""
    return {"op": "stream", "method": method, "way": way, "id": req, "num_layers": num_layers, "tokens": tokens,
            "poster": poster, "forward_stream": forward_stream,
            "page_bytes": page_bytes, "layer_ms": layer_ms, "device": device,
            "decode_ids": [int(b) for b in loc], "prefill_ids": [int(b) for b in rem]}
