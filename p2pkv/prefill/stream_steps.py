"""Prefill scheduler side of layer-streamed transfer: which blocks each step computes for a streamed request.

A prefill leg whose ``kv_transfer_params`` carry a stream grant
(:mod:`p2pkv.grant`) is streamed: each engine step, the workers need the
blocks that step's forward writes for it, so that after every attention
layer they can WRITE that layer's pages of those blocks into the decode
rank (:mod:`p2pkv.prefill.streams`). vLLM's ``SchedulerOutput`` says which
requests a step runs, how many tokens each, and the blocks they were given;
:class:`StreamSteps` turns that into one :class:`~p2pkv.metadata.StreamChunk`
per streamed request per step. A chunk covers the prompt's blocks from the
block its first token falls in to the block its last token falls in (the
first chunk, and the first after a preemption, from block 0, so a prefix
this engine had cached goes with it).

A preempted request's blocks are freed by vLLM at once, and may hold another
request's KV before the stream has WRITTEN them: the step that preempts it
tells the workers (:attr:`~p2pkv.metadata.P2pKvMetadata.stream_restarts`,
from ``SchedulerOutput.preempted_req_ids``), whose stream then drops the
layers it has not WRITTEN yet; the request's layers come again, from block
0, once it is resumed.

A model with several KV cache groups (vLLM's hybrid KV cache manager:
sliding-window and full-attention layers, attention and Mamba layers) has
one block list per group; a chunk carries each group's blocks
(:attr:`~p2pkv.metadata.StreamChunk.group_blocks`). An attention group's
cover the same tokens as group 0's (one block size); vLLM's null block
(id 0: behind a sliding window, freed or never kept) is left out of the
front. A state group's (Mamba/SSM) go once, all of them, in the last chunk:
its layers report nothing per layer, and only the state after the prompt's
last step is the one to move.

Only a grant this side can check is streamed: one the proxy signed for
:data:`p2pkv.grant.ANY_DECODE` under this engine's id and secret (the decode
engine is not known here). So no HTTP caller without the secret can make a
streamed request, whose hold no cap refuses: a stream may be WRITING from
its blocks when the request ends, so they stay until the stream has ended.
A request with a grant this side cannot check is held for a pull or push
as without one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from handshake import GroupBlocks
from p2pkv.grant import ANY_DECODE, GRANT_KEY, StreamGrantError, check_stream_grant
from p2pkv.metadata import StreamChunk
from p2pkv.params import prompt_digest

logger = logging.getLogger("p2pkv.scheduler")


@dataclass
class _Streamed:
    """A streamed request the scheduler follows: its stream id, blocks so far (one list per KV cache group),
    and digest."""

    stream_id: str
    prompt_tokens: int
    digest: str
    loaded_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)
    started: bool = False


class StreamSteps:
    """Each step's :class:`~p2pkv.metadata.StreamChunk` of the streamed requests of one prefill engine.

    Args:
        engine_id: this engine's id (the grant must name it).
        secret: the side channel's secret (None: nothing is streamed).
        block_size: tokens per block of this engine.
        recompute_tokens: prompt tokens a decode engine computes itself (see
            :class:`p2pkv.scheduler.SchedulerSide`); the decode engine of a
            stream computes at least one, so it loads all but ``max(1, recompute_tokens)``
            of the original prompt (all of this engine's shortened prompt when ``recompute_tokens`` > 0).
        kv_groups: KV cache groups of this engine (their attention groups share ``block_size``).
        state_groups: the indices of its state groups (Mamba/SSM; :func:`p2pkv.compat.state_group_indices`).
    """

    def __init__(self, engine_id: str, secret: bytes | None, block_size: int, recompute_tokens: int,
                 kv_groups: int, state_groups: frozenset[int] = frozenset()) -> None:
        self.engine_id = engine_id
        self._secret = secret
        self.block_size = block_size
        self.recompute_tokens = recompute_tokens
        self.kv_groups = kv_groups
        self.state_groups = state_groups
        self._requests: dict[str, _Streamed] = {}
        self._stream_ids: set[str] = set()
        self.aborts: dict[str, str] = {}
        self.restarts: list[str] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def on_new_request(self, request: Any, now: float | None = None) -> None:
        """Follow ``request`` when its params carry a usable grant (its stream id not taken by another request
        here; a bad grant is logged and the request is held for a push, as without one)."""
        params = request.kv_transfer_params
        if not self._secret:
            logger.warning("p2pkv: request %s asks to stream; not streamed (this engine has no side-channel "
                           "secret to check its grant with)", request.request_id)
            return
        try:
            grant = check_stream_grant(params.get(GRANT_KEY), self._secret, prefill_engine_id=self.engine_id,
                                       decode_engine_id=ANY_DECODE, now=time.time() if now is None else now)
        except StreamGrantError as exc:
            logger.warning("p2pkv: request %s: %s; not streamed (held for a pull or push)", request.request_id, exc)
            return
        ids = request.prompt_token_ids
        if ids is None or grant.stream_id in self._stream_ids:
            why = ("a prompt given as embeddings" if ids is None
                   else f"stream id {grant.stream_id} is already streamed here (a replayed grant)")
            logger.warning("p2pkv: request %s asks to stream; not streamed (%s)", request.request_id, why)
            return
        loaded = len(ids) - 1 if self.recompute_tokens == 0 else len(ids)
        if loaded < 1:
            return
        self._stream_ids.add(grant.stream_id)
        self._requests[request.request_id] = _Streamed(grant.stream_id, len(ids), prompt_digest(ids[:loaded]),
                                                       loaded)

    def chunks(self, scheduler_output: Any) -> list[StreamChunk]:
        """This step's chunks of the streamed requests it runs (``scheduler_output``: vLLM's ``SchedulerOutput``,
        read before vLLM advances the requests' ``num_computed_tokens``)."""
        if not self._requests:
            return []
        for req_id in sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()):
            if (streamed := self._requests.get(req_id)) is not None:  # its blocks are freed: it starts again
                streamed.block_ids = []
                streamed.started = False
                self.restarts.append(req_id)
        counts: dict[str, int] = scheduler_output.num_scheduled_tokens
        out = []
        for new in scheduler_output.scheduled_new_reqs:
            if (streamed := self._requests.get(new.req_id)) is not None:
                streamed.block_ids = [list(ids) for ids in new.block_ids]
                out.append(self._chunk(new.req_id, streamed, 0, new.num_computed_tokens, counts.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            if (streamed := self._requests.get(req_id)) is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in resumed:  # preempted and back: its blocks were given anew, its tokens recomputed
                streamed.block_ids = [list(ids) for ids in added] if added else []
                streamed.started = False
            elif added:
                for mine, ids in zip(streamed.block_ids, added, strict=False):
                    mine.extend(ids)
            computed = cached.num_computed_tokens[i]
            first = 0 if not streamed.started else computed // self.block_size
            out.append(self._chunk(req_id, streamed, first, computed, counts.get(req_id, 0)))
        return out

    def _chunk(self, request_id: str, streamed: _Streamed, first_block: int, computed: int,
               scheduled: int) -> StreamChunk:
        end = min(computed + scheduled, streamed.prompt_tokens)
        last_block = -(-end // self.block_size)
        opening = not streamed.started
        streamed.started = True
        last = end >= streamed.prompt_tokens
        groups = []
        for group, ids in enumerate(streamed.block_ids or [[]]):
            if group in self.state_groups:
                groups.append(_unnulled(0, ids) if last else GroupBlocks(0, []))
            else:
                groups.append(_unnulled(first_block, ids[first_block:last_block]))
        return StreamChunk(request_id, streamed.stream_id, groups[0].first_block, tuple(groups[0].block_ids), end,
                           last, streamed.digest if opening else "", streamed.loaded_tokens if opening else 0,
                           tuple(groups[1:]))

    def finished(self, request_id: str, completed: bool) -> bool:
        """``request_id`` ended (``completed``: by length or stop; else aborted); True when it was streamed.
        An aborted one's stream is told to stop (:attr:`aborts`, for the workers' next step)."""
        streamed = self._requests.pop(request_id, None)
        if streamed is None:
            return False
        self._stream_ids.discard(streamed.stream_id)
        if not completed:
            self.aborts[request_id] = "the prefill request was aborted"
        return True

    def take_aborts(self) -> dict[str, str]:
        """Streams to stop (prefill request id → why), then forgotten."""
        out, self.aborts = self.aborts, {}
        return out

    def take_restarts(self) -> list[str]:
        """Streamed requests preempted since the last call (their streams drop the layers not WRITTEN yet:
        :meth:`p2pkv.prefill.streamer.LayerStream.restart`), then forgotten."""
        out, self.restarts = self.restarts, []
        return out


NULL_BLOCK = 0
"""vLLM's null block id: a position of a request's block list that holds nothing (behind a sliding window)."""


def _unnulled(first_block: int, block_ids: list[int]) -> GroupBlocks:
    """Blocks ``first_block ..`` of a group without the null blocks at their front (a sliding window's
    positions that hold nothing)."""
    skip = 0
    while skip < len(block_ids) and block_ids[skip] == NULL_BLOCK:
        skip += 1
    return GroupBlocks(first_block + skip, list(block_ids[skip:]))
