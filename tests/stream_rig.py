"""A prefill rank's :class:`~p2pkv.prefill.prefill_streams.PrefillStreams` beside a decode agent, over two real NIXL
agents in this process (UCX moves host memory): one request streamed into rank 0 of the decode engine, and what the
tests check of it (the decode blocks' bytes, the notifications, the holds)."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import torch

from handshake import PROTOCOL_VERSION, StreamRequest
from p2pkv.dataplane.negotiate import ModelInfo, layout_desc
from p2pkv.grant import make_stream_grant
from p2pkv.metadata import P2pKvMetadata, StreamChunk
from p2pkv.notification import PUSH_PREFIX, PushedNotification, parse_pushed
from p2pkv.prefill.holds import PrefillHolds
from p2pkv.prefill.layer_stream import LayerStream
from p2pkv.prefill.prefill_streams import PrefillStreams
from p2pkv.prefill.pusher import Pusher
from p2pkv.prefill.stream_requests import stream_side
from p2pkv.prefill.write_engine import WriteEngine
from p2pkv.prompt_digest import prompt_digest
from tests.clock import FakeClock
from tests.push_support import DECODE, ENGINE, KEY, SHAPE, Agents

PID = bytes(range(100, 116))
LAYERS = SHAPE["num_layers"]
MODEL = ModelInfo("BLHNC", "float32", SHAPE["num_heads"], SHAPE["head_dim"], SHAPE["block_size"])
DIGEST = prompt_digest(list(range(31)))  # the decode engine loads all but the prompt's last token
REQ = "prefill-req-1"


@dataclass
class Rig:
    """A prefill rank's streams (fake clock) beside the decode agent of ``agents``, and one stream id."""

    agents: Agents
    holds: PrefillHolds
    pusher: Pusher
    streams: PrefillStreams
    clock: Callable[[], float]
    stream_id: str = field(default_factory=lambda: secrets.token_hex(16))
    ended: list[LayerStream] = field(default_factory=list)

    def chunk(self, block_ids: tuple[int, ...], first_block: int = 0, num_tokens: int = 32,
              last: bool = True) -> P2pKvMetadata:
        """One step's metadata with one chunk of REQ (the first chunk carries the digest)."""
        first = first_block == 0
        return P2pKvMetadata(streams=[StreamChunk(REQ, self.stream_id, first_block, block_ids, num_tokens, last,
                                                  DIGEST if first else "", 31 if first else 0)])

    def request(self, block_ids: list[int], window_s: float = 30.0, readers: int = 1) -> StreamRequest:
        """Rank 0 of DECODE's destination for the stream, sent now (``readers``: DECODE ranks that read this
        prefill rank)."""
        info = msgspec.structs.replace(self.agents.info(), layout=layout_desc(self.agents.decode_layout, MODEL,
                                                                              "HND", mem_type="DRAM"))
        grant = make_stream_grant(ENGINE, DECODE, KEY, time.time() + 60, self.stream_id)
        return StreamRequest(protocol_version=PROTOCOL_VERSION, to_engine_id=ENGINE, to_rank=0, sent_at=time.time(),
                             nonce=os.urandom(16), requester_engine_id=DECODE, grant=grant, block_ids=block_ids,
                             first_block=0, num_tokens=31, prompt_digest=DIGEST, push_id=PID, agent=info,
                             window_s=window_s, readers=readers)

    def step(self, meta: P2pKvMetadata) -> None:
        """The forward of ``meta``'s step: every layer done, then the step's end."""
        self.streams.prepare(meta)
        for layer in range(LAYERS):
            self.streams.save_layer(f"layers.{layer}", meta)
        self.streams.end_step()

    def landed(self, pairs: dict[int, int], layers: Iterable[int]) -> bool:
        """Layers ``layers`` of decode blocks ``pairs.values()`` hold the prefill's ``pairs.keys()``; all else 0."""
        want = torch.zeros_like(self.agents.target)
        for src, dst in pairs.items():
            for layer in layers:
                want[dst, layer] = self.agents.source[src, layer]
        return torch.equal(self.agents.target, want)

    def wait_landed(self, pairs: dict[int, int], layers: Iterable[int], timeout_s: float = 10.0) -> None:
        layers, deadline = list(layers), time.monotonic() + timeout_s
        while not self.landed(pairs, layers):
            assert time.monotonic() < deadline, f"layers {layers} of {pairs} did not land"
            self.agents.decode.progress()
            time.sleep(0.001)

    def notes(self, timeout_s: float = 10.0) -> list[PushedNotification]:
        """The "pushed" notifications the decode agent received (waits up to ``timeout_s`` for the first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.agents.decode.progress()
            got = [parse_pushed(m, KEY) for m in self.agents.decode.take_notifs(PUSH_PREFIX)]
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.002)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Collect until no stream is left (the ended ones recorded in :attr:`ended`)."""
        deadline = time.monotonic() + timeout_s
        while self.streams._live:
            assert time.monotonic() < deadline, "a stream did not end"
            self.agents.decode.progress()
            self.streams.collect()
            time.sleep(0.002)

    def settle_ended(self, count: int, timeout_s: float = 10.0) -> None:
        """Collect until ``count`` streams have ended (the request may stay known: it can wait for more)."""
        deadline = time.monotonic() + timeout_s
        while len(self.ended) < count:
            assert time.monotonic() < deadline, f"{count} stream(s) did not end"
            self.agents.decode.progress()
            self.streams.collect()
            time.sleep(0.002)

    def streams_held(self) -> int:
        """Streams (destinations) that keep rank 0 of DECODE loaded now."""
        entry = self.pusher.engine.agents.get((DECODE, 0))
        return 0 if entry is None else entry.streams


@contextlib.contextmanager
def open_rig(agents: Agents, clock: Callable[[], float] | None = None, layer_of: dict[str, int] | None = None,
             **settings: object) -> Iterator[Rig]:
    """A :class:`Rig` on ``agents`` (the decode cache zeroed, notes left by earlier tests dropped): its streams on
    ``clock`` (default: a :class:`~tests.clock.FakeClock`), its layers named ``layer_of`` (default
    ``layers.<i>``), with ``settings`` as keyword arguments of
    :class:`~p2pkv.prefill.prefill_streams.PrefillStreams`."""
    agents.target.zero_()
    agents.decode.take_notifs(PUSH_PREFIX)  # notes an earlier test left; kept apart from now on
    holds = PrefillHolds(lease_s=30.0)
    pusher = Pusher(WriteEngine(agents.prefill, KEY), holds, agents.layout)
    clock = FakeClock() if clock is None else clock
    source = stream_side(layout_desc(agents.layout, MODEL, "HND", mem_type="DRAM"))
    streams = PrefillStreams(ENGINE, pusher.engine, holds, source,
                             layer_of or {f"layers.{i}": i for i in range(LAYERS)}, KEY, clock=clock,
                             **settings)  # type: ignore[arg-type]
    made = Rig(agents, holds, pusher, streams, clock)
    take_ended = streams.poster.take_ended

    def recorded() -> list[LayerStream]:
        got = take_ended()
        made.ended.extend(got)
        return got

    streams.poster.take_ended = recorded  # type: ignore[method-assign]
    try:
        yield made
    finally:
        streams.close()
        pusher.close()
