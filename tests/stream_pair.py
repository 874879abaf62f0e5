"""Two real NIXL agents in this process (UCX moves host memory) with a prefill and a decode KV cache, as the
layer-stream tests use them: a prefill agent with a random cross-layer cache, a decode agent with a zeroed
per-layer one, and what the tests check of a stream between them (the decode blocks' bytes, the notifications)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from p2pkv.dataplane.agent import NixlTransferAgent, unique_agent_name
from p2pkv.dataplane.layers import page_segments
from p2pkv.dataplane.layout import KVLayout, Segment, describe_torch_kv_caches
from p2pkv.notification import PUSH_PREFIX, PushedNotification, parse_pushed
from p2pkv.prefill.layer_stream import LayerStream, StreamSide, StreamTarget
from p2pkv.prefill.poster import StreamPoster
from p2pkv.testing import make_kv_caches
from p2pkv.tools.doctor import loopback_info

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 24, 2, 16, 8
PAGE = HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 4  # float32, K and V side by side
PUSH_ID = b"stream-test-push-id-0001"
KEY = b"stream-test-secret"


def kv_layout(layout: str, **kw: object) -> tuple[torch.Tensor, dict[str, torch.Tensor], KVLayout]:
    """A KV cache of ``layout`` (:func:`p2pkv.testing.make_kv_caches`, this module's shape): its base tensor, its
    views by layer name and its layout."""
    base, views = make_kv_caches(layout, num_layers=LAYERS, num_blocks=BLOCKS, num_heads=HEADS,
                                 block_size=BLOCK_SIZE, head_dim=HEAD_DIM, **kw)
    return base, views, describe_torch_kv_caches(views, BLOCKS)


@dataclass
class Pair:
    """A prefill agent with a random cross-layer cache and a decode agent with a zeroed per-layer one."""

    prefill: NixlTransferAgent
    decode: NixlTransferAgent
    decode_name: str
    source: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    source_pages: list[Segment]
    target_pages: list[Segment]

    def stream(self, writer: object | None = None) -> LayerStream:
        return LayerStream("req-1", StreamSide(tuple(self.source_pages), BLOCKS), writer or self.prefill,
                           secret=KEY)

    def target_of(self, block_ids: list[int], first_block: int = 0, pages: list[Segment] | None = None
                  ) -> StreamTarget:
        side = StreamSide(tuple(self.target_pages if pages is None else pages), BLOCKS)
        return StreamTarget(self.decode_name, side, tuple(block_ids), first_block, PUSH_ID)

    def notes(self, timeout_s: float = 5.0) -> list[PushedNotification]:
        """The "pushed" notifications the decode agent received (waits up to ``timeout_s`` for the first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.prefill.progress()  # a notification goes out as the sender's worker progresses
            got = [parse_pushed(m, KEY) for m in self.decode.take_notifs(PUSH_PREFIX)]
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.002)

    def landed(self, src_ids: list[int], dst_ids: list[int], layers: range = range(LAYERS)) -> bool:
        """Layers ``layers`` of decode blocks ``dst_ids`` hold the prefill's ``src_ids``; the rest is zero."""
        for layer in range(LAYERS):
            src, dst = self.source[f"layers.{layer}"], self.target[f"layers.{layer}"]
            want = torch.zeros_like(dst)
            if layer in layers:
                want[dst_ids] = src[src_ids]
            if not torch.equal(dst, want):
                return False
        return True


@contextlib.contextmanager
def open_pair(device: str = "cpu") -> Iterator[Pair]:
    """A :class:`Pair` on ``device`` (``cpu`` or a CUDA device: the caches in its memory), closed on exit."""
    _, source, src_layout = kv_layout("BLHNC", seed=3, device=device)
    _, target, dst_layout = kv_layout("LBHNC", fill=0.0, device=device)
    mem = "VRAM" if device.startswith("cuda") else "DRAM"
    prefill = NixlTransferAgent(unique_agent_name("prefill-engine", 0))
    decode = NixlTransferAgent(unique_agent_name("decode-engine", 0))
    try:
        prefill.register(src_layout.regions, mem)
        decode.register(dst_layout.regions, mem)
        name = prefill.add_peer(loopback_info(decode), role="decode")
        decode.take_notifs(PUSH_PREFIX)  # "pushed" notifications kept apart from now on, as a receiver asks
        yield Pair(prefill, decode, name, source, target, page_segments(src_layout.segments, PAGE),
                   page_segments(dst_layout.segments, PAGE))
    finally:
        with contextlib.suppress(Exception):
            decode.close()
        prefill.close()


def drain(stream: LayerStream, pair: Pair, timeout_s: float = 10.0) -> None:
    """Pump until the stream ends, progressing the decode agent as its receiver's thread does."""
    deadline = time.monotonic() + timeout_s
    while stream.pump():
        assert time.monotonic() < deadline, f"stream still {stream.state} after {timeout_s} s"
        pair.decode.progress()
        time.sleep(0.0005)


def ended_on(poster: StreamPoster, pair: Pair, timeout_s: float = 10.0) -> list[LayerStream]:
    """Wait for the poster to hand back ended streams, progressing the decode agent meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not (ended := poster.take_ended()):
        assert time.monotonic() < deadline, "no stream ended"
        pair.decode.progress()
        time.sleep(0.001)
    return ended
