"""Prefill scheduler side of layer-streamed transfer: which blocks each step computes for a streamed request.

A prefill leg whose ``kv_transfer_params`` carry a stream grant
(:mod:`p2pkv.grant`) is streamed: each engine step, the workers need the
blocks that step's forward writes for it, so that after every attention
layer they can WRITE that layer's pages of those blocks into the decode
rank (:mod:`p2pkv.prefill.prefill_streams`). vLLM's ``SchedulerOutput`` says which
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
engine is not known here), whose expiry lies within ``max_lifetime_s`` of
this engine's clock. A request with a grant this side cannot check is held
for a pull or push as without one.

A grant serves one request for its whole life: its stream id is bound to
the first request that names it (:class:`p2pkv.bindings.Bindings`, until the
grant expires) and any later request naming it (a replayed grant: whoever
saw the proxy → engine hop has it) is refused before any hold, answered
without one. A stream's blocks count in the engine's one
:class:`~p2pkv.scheduling.hold_ledger.HoldLedger` from its request's arrival
(its prompt's blocks, every KV cache group's): once its stream has a
destination they stay until the stream has ended, so a stream that would
pass ``max_held_fraction`` is not streamed at all, and its destination is
refused at once (:attr:`~p2pkv.metadata.P2pKvMetadata.stream_refusals`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from handshake import GroupBlocks
from p2pkv.bindings import Bindings
from p2pkv.grant import ANY_DECODE, GRANT_KEY, StreamGrantError, check_stream_grant
from p2pkv.metadata import StreamChunk
from p2pkv.params import CLOCK_SKEW_S
from p2pkv.prompt_digest import prompt_digest
from p2pkv.scheduling.hold_ledger import HoldLedger

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
        state_groups: the indices of its state groups (Mamba/SSM; :func:`p2pkv.engine_facts.state_group_indices`).
        ledger: the engine's hold ledger (None: a ledger of its own with no cap).
        max_lifetime_s: how far past this engine's clock a grant's expiry may lie (seconds;
            :attr:`p2pkv.config.P2pKvConfig.max_lifetime_s`).
        pp_size: this engine's pipeline stages (the grant must name them).
    """

    def __init__(self, engine_id: str, secret: bytes | None, block_size: int, recompute_tokens: int,
                 kv_groups: int, state_groups: frozenset[int] = frozenset(), ledger: HoldLedger | None = None,
                 max_lifetime_s: float = 480.0, pp_size: int = 1) -> None:
        self.engine_id = engine_id
        self._secret = secret
        self.block_size = block_size
        self.recompute_tokens = recompute_tokens
        self.kv_groups = kv_groups
        self.state_groups = state_groups
        self.ledger = HoldLedger(None, 1.0) if ledger is None else ledger
        self.max_lifetime_s = max_lifetime_s
        self.pp_size = pp_size
        self._requests: dict[str, _Streamed] = {}
        self.bound = Bindings("stream id")
        self.aborts: dict[str, str] = {}
        self.restarts: list[str] = []
        self.admits: dict[str, tuple[str, float]] = {}
        self.refusals: dict[str, str] = {}
        self._no_hold: dict[str, str] = {}  # request id → why it is answered without a hold (a replayed grant)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def on_new_request(self, request: Any, now: float | None = None) -> None:
        """Follow ``request`` when its params carry a usable grant (a bad grant is logged and the request is held
        for a push, as without one). A grant whose stream id already serves another request here is refused: the
        request will be answered without a hold (:meth:`refusal`). A stream whose blocks would pass
        ``max_held_fraction`` is not streamed either; its destination is refused at once (:attr:`refusals`)."""
        params = request.kv_transfer_params
        if not self._secret:
            logger.warning("p2pkv: request %s asks to stream; not streamed (this engine has no side-channel "
                           "secret to check its grant with)", request.request_id)
            return
        now = time.time() if now is None else now
        try:
            grant = check_stream_grant(params.get(GRANT_KEY), self._secret, prefill_engine_id=self.engine_id,
                                       decode_engine_id=ANY_DECODE, now=now, max_lifetime_s=self.max_lifetime_s,
                                       pp_size=self.pp_size)
        except StreamGrantError as exc:
            logger.warning("p2pkv: request %s: %s; not streamed (held for a pull or push)", request.request_id, exc)
            return
        ids = request.prompt_token_ids
        if ids is None:
            logger.warning("p2pkv: request %s asks to stream; not streamed (a prompt given as embeddings)",
                           request.request_id)
            return
        if (why := self.bound.bind(grant.stream_id, request.request_id, grant.expiry + CLOCK_SKEW_S, now)) is not None:
            logger.warning("p2pkv: request %s asks to stream; refused, answered without a hold: %s",
                           request.request_id, why)
            self._no_hold[request.request_id] = why
            return
        loaded = len(ids) - 1 if self.recompute_tokens == 0 else len(ids)
        if loaded < 1:
            return
        blocks = -(-len(ids) // self.block_size) * self.kv_groups
        if (why := self.ledger.refusal(blocks)) is not None:
            logger.warning("p2pkv: request %s asks to stream; not streamed: %s", request.request_id, why)
            self.refusals[grant.stream_id] = why
            self._no_hold[request.request_id] = why
            return
        self.ledger.count(request.request_id, blocks)
        self.admits[request.request_id] = (grant.stream_id, float(grant.expiry))
        self._requests[request.request_id] = _Streamed(grant.stream_id, len(ids), prompt_digest(ids[:loaded]),
                                                       loaded)

    def refusal(self, request_id: str) -> str | None:
        """Why ``request_id``, which asked to stream, is answered without a hold (its grant already served
        another request, or its blocks would pass the cap), then forgotten; None for any other request."""
        return self._no_hold.pop(request_id, None)

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
        An aborted one's stream is told to stop (:attr:`aborts`, for the workers' next step). Its stream id stays
        bound to it until the grant expires."""
        streamed = self._requests.pop(request_id, None)
        if streamed is None:
            return False
        if not completed:
            self.aborts[request_id] = "the prefill request was aborted"
        return True

    def take_aborts(self) -> dict[str, str]:
        """Streams to stop (prefill request id → why), then forgotten."""
        out, self.aborts = self.aborts, {}
        return out

    def take_admits(self) -> tuple[dict[str, tuple[str, float]], dict[str, str]]:
        """The streams admitted since the last call (request id → (stream id, grant expiry)) and the stream ids
        refused (→ why), for the workers, then forgotten."""
        out = self.admits, self.refusals
        self.admits, self.refusals = {}, {}
        return out

    def take_restarts(self) -> list[str]:
        """Streamed requests preempted since the last call (their streams drop the layers not WRITTEN yet:
        :meth:`p2pkv.prefill.layer_stream.LayerStream.restart`), then forgotten."""
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
