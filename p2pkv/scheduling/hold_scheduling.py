"""The prefill half of the connector's scheduler side: which finished requests hold their blocks for a decode
engine, and the signed ``kv_transfer_params`` that say where they are.

An engine holds blocks only when its role allows it (``role``: ``prefill`` or ``both``), and never more than
``max_held_fraction`` of its KV cache at once, over every way of moving KV (one
:class:`~p2pkv.scheduling.hold_ledger.HoldLedger`, which a layer stream enters when its request arrives: see
:mod:`p2pkv.scheduling.stream_steps`): past that a request is answered without a hold (its params say so and the
decode engine prefills it itself), so no caller of the engine's HTTP API can pin its cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from p2pkv.config import P2pKvConfig, Role
from p2pkv.params import make_prefill_response_params, wants_remote_decode
from p2pkv.prompt_digest import prompt_digest
from p2pkv.scheduling.hold_ledger import HoldLedger
from p2pkv.telemetry.hold_spans import HoldEnd, emit_hold_span
from p2pkv.telemetry.tracing import TRACEPARENT_KEY, Tracing, parse_traceparent, traces_endpoint
from p2pkv.turns import make_turn_params

logger = logging.getLogger("p2pkv.scheduler")

Request = Any
"""vLLM's ``vllm.v1.request.Request`` (this package does not import vLLM; :mod:`p2pkv.scheduler` does)."""

NO_HOLD_KEY = "p2pkv_no_hold"
"""``kv_transfer_params`` key of an answer given without a hold: why (the decode engine prefills the prompt)."""


class PrefillScheduling:
    """Holds for remote decodes, decided when a request finishes.

    Args:
        engine_id: this engine's id (named in the params it hands out).
        config: p2pkv settings (``lease_s``, ``max_held_fraction``, tracing).
        role: what this engine does (:func:`p2pkv.config.engine_role`); ``decode`` holds nothing.
        host / port: where decode engines reach this engine's side channel (rank 0's port).
        tp_size: this engine's tensor-parallel size.
        secret: signs the params (None: an insecure deployment, unsigned params).
        recompute_tokens: prompt tokens a decode engine computes itself (see
            :class:`p2pkv.scheduler.SchedulerSide`); with any, the request's first
            token is not handed to the client from here.
        num_blocks: blocks of this engine's KV cache (None or 0: unknown, no cap).
        clock: monotonic seconds, the leases' clock (the workers' holds read the same one).
        pp_size: this engine's pipeline-parallel size (its answers' ``pp_size``: every stage's workers hold the
            blocks, each its own layers).
    """

    def __init__(self, engine_id: str, config: P2pKvConfig, role: Role, host: str, port: int, tp_size: int,
                 secret: bytes | None, recompute_tokens: int = 0, num_blocks: int | None = None,
                 clock: Callable[[], float] = time.monotonic, pp_size: int = 1) -> None:
        self.engine_id = engine_id
        self.config = config
        self.role = role
        self.host = host
        self.port = port
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.recompute_tokens = recompute_tokens
        self._secret = secret
        self.ledger = HoldLedger.of(num_blocks, config.max_held_fraction)
        self._clock = clock
        self._tracing = bool(traces_endpoint())
        self.leases: dict[str, float] = {}
        self.blocks: dict[str, tuple[int, ...]] = {}
        self.traces: dict[str, tuple[str, int]] = {}

    @property
    def max_held_blocks(self) -> int | None:
        """Most blocks held for remote engines at once (None: no cap)."""
        return self.ledger.cap

    @property
    def held_blocks(self) -> int:
        """Blocks held (or promised to a stream) for remote engines now, over every way."""
        return self.ledger.held_blocks

    def take(self) -> tuple[dict[str, float], dict[str, tuple[int, ...]], dict[str, tuple[str, int]]]:
        """This step's new leases, their block ids and trace contexts (for the workers), then forgotten."""
        out = self.leases, self.blocks, self.traces
        self.leases, self.blocks, self.traces = {}, {}, {}
        return out

    def on_new_request(self, request: Request) -> None:
        """Leave a request prefilled for a decode engine its last ``recompute_tokens`` to the decode engine."""
        if self.recompute_tokens and self.role != "decode" and wants_remote_decode(request.kv_transfer_params):
            leave_tail_to_decode(request, self.recompute_tokens)

    def on_sent(self, request_ids: set[str] | frozenset[str]) -> None:
        """The workers released these requests' holds (notified, released, expired): their blocks count no more."""
        for request_id in request_ids:
            self.ledger.release(request_id)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...], completed: bool,
                         streamed: bool = False, refusal: str | None = None) -> tuple[bool, dict[str, Any] | None]:
        """Hold a finished request's blocks (every KV cache group's) for a decode engine and say where they are.

        Args:
            request: the finished request (its ``kv_transfer_params`` ask for a remote decode).
            block_ids: its block ids per KV cache group, in token order (a sliding-window group's blocks
                behind the window are vLLM's null block, id 0).
            completed: it finished by length or stop (not aborted).
            streamed: it was layer-streamed (:mod:`p2pkv.scheduling.stream_steps`): held whatever its end and
                the cap, since its stream may still be WRITING from its blocks (the workers end the hold as
                soon as the stream has ended); an aborted one is held with no params. Its blocks have counted
                against the cap since it arrived (:class:`~p2pkv.scheduling.hold_ledger.HoldLedger`).
            refusal: why a request that asked to stream gets no hold at all (its grant already served another
                request here, or its stream would have passed the cap: :meth:`StreamSteps.refusal`).

        Returns:
            ``(hold, params)``: ``hold`` True when the blocks stay allocated until the decode side's
            notification or the lease (``lease_s``) ends; ``params`` the NixlConnector-compatible
            ``kv_transfer_params`` for the decode engine, or, without a hold because of this engine's role or
            cap, params saying so (:data:`NO_HOLD_KEY`: the decode engine prefills the prompt itself).
        """
        params = request.kv_transfer_params
        flat = tuple(b for group in block_ids for b in group)
        if streamed and not completed and any(flat):
            self._hold(request, flat, params)
            return True, None  # held until its stream has stopped
        self.ledger.release(request.request_id)  # a stream's count, from its arrival: held below, or not at all
        if not completed:
            self._trace_aborted(request, params)
            return False, None  # aborted on the prefill side: free the blocks now
        if not any(flat):
            return False, None
        if refusal is None and not streamed:
            refusal = self._refusal(held_count(flat))
        if refusal is not None:
            logger.warning("p2pkv: request %s asks for a remote decode; answered without a hold: %s",
                           request.request_id, refusal)
            return False, {"do_remote_prefill": False, NO_HOLD_KEY: refusal}
        self._hold(request, flat, params)
        expiry = time.time() + self.config.lease_s
        answer = make_prefill_response_params(
            engine_id=self.engine_id, request_id=request.request_id, host=self.host, port=self.port,
            block_ids=flat, group_sizes=tuple(len(g) for g in block_ids) if len(block_ids) > 1 else (),
            tp_size=self.tp_size, pp_size=self.pp_size, num_tokens=request.num_computed_tokens, expiry_time=expiry,
            first_token=self.recompute_tokens == 0, prompt_digest=computed_digest(request), secret=self._secret)
        return True, answer

    def keep_turn(self, request: Request, block_ids: tuple[list[int], ...],
                  completed: bool) -> tuple[bool, dict[str, Any] | None]:
        """Keep a finished request's blocks (its prompt's and generated tokens' KV) for its conversation's next
        turn (``keep_turns_s``), whose prefill engine loads them (:func:`p2pkv.turns.wants_turn_load`).

        Counted against ``max_held_fraction`` with every other hold, leased for ``keep_turns_s``, freed when the
        next turn's prefill engine has loaded them, or tells this engine that it will not (a conversation that
        moved on), or the lease ends. Not kept: an aborted request, a prompt given as embeddings, or past the cap.
        Every model kind keeps them as they are: vLLM freed the blocks behind an attention window for the
        ``num_computed_tokens`` kept (the next turn's prefill engine, loading exactly those tokens, skips the same
        blocks), and a Mamba state block holds the state after exactly those tokens (docs/multi-turn.md).

        Args:
            request: the finished request (a decode leg, or a request with no remote prefill at all).
            block_ids: its block ids per KV cache group, in token order.
            completed: it finished by length or stop.

        Returns:
            ``(hold, params)``: the params that name the kept blocks and bind their tokens
            (:func:`p2pkv.turns.make_turn_params`), for the client's next turn; ``(False, None)`` when not kept.
        """
        flat = tuple(b for group in block_ids for b in group)
        tokens = request.all_token_ids
        kept = request.num_computed_tokens
        if not completed or not any(flat) or request.prompt_token_ids is None or not 0 < kept <= len(tokens):
            return False, None
        refusal = self.ledger.refusal(held_count(flat))
        if refusal is not None:
            logger.info("p2pkv: request %s: its blocks are not kept for a next turn: %s", request.request_id, refusal)
            return False, None
        params = request.kv_transfer_params or {}
        self._hold(request, flat, params, self.config.keep_turns_s)
        answer = make_turn_params(
            engine_id=self.engine_id, request_id=request.request_id, host=self.host, port=self.port,
            block_ids=flat, group_sizes=tuple(len(g) for g in block_ids) if len(block_ids) > 1 else (),
            tp_size=self.tp_size, num_tokens=kept, expiry_time=time.time() + self.config.keep_turns_s,
            prompt_digest=prompt_digest(list(tokens[:kept])), secret=self._secret)
        return True, answer

    def _hold(self, request: Request, flat: tuple[int, ...], params: dict[str, Any],
              lease_s: float | None = None) -> None:
        """Hold ``flat`` (every group's block ids) for ``request``: counted, leased (``lease_s``, default the
        setting's), traced."""
        self.ledger.count(request.request_id, held_count(flat))
        self.leases[request.request_id] = self._clock() + (lease_s or self.config.lease_s)
        self.blocks[request.request_id] = flat
        if self._tracing and (trace := parse_traceparent(params.get(TRACEPARENT_KEY))):
            self.traces[request.request_id] = (trace, time.time_ns())

    def _refusal(self, blocks: int) -> str | None:
        """Why ``blocks`` more may not be held now (None: they may)."""
        if self.role == "decode":
            return ("this engine's role is decode (kv_connector_extra_config role, or kv_role kv_consumer): it "
                    "holds no blocks for other engines; send prefill legs to a prefill engine")
        return self.ledger.refusal(blocks)

    def _trace_aborted(self, request: Request, params: dict[str, Any]) -> None:
        """A request aborted on the prefill engine ends its hold before it began: a ``p2pkv.hold`` span of no
        length, ended ``aborted`` (with tracing on and a trace context in its params)."""
        if self._tracing and (trace := parse_traceparent(params.get(TRACEPARENT_KEY))):
            tracing = Tracing.get("p2pkv-prefill", traces_endpoint())
            if tracing is not None:
                emit_hold_span(tracing, request.request_id, trace, time.time_ns(), HoldEnd.ABORTED, self.engine_id,
                               None, 0)


def held_count(block_ids: tuple[int, ...]) -> int:
    """Blocks a hold of ``block_ids`` (every KV cache group's) keeps from vLLM's pool: all but vLLM's null block
    (id 0: behind a sliding window, freed already), which a window model's long request has many of."""
    return sum(1 for block_id in block_ids if block_id)


def leave_tail_to_decode(request: Request, tokens: int) -> None:
    """Drop the prompt's last ``tokens`` tokens from a request prefilled for a decode engine.

    The decode engine computes them (see ``recompute_tokens``); the request then ends after one sampled token,
    which no client should read (the proxy takes only ``kv_transfer_params`` from the prefill engine). A request
    that skips the prefix cache (prompt logprobs) is left whole: the decode engine then refuses its params and
    prefills it itself.
    """
    if request.prompt_token_ids is None or request.num_prompt_tokens <= tokens or request.skip_reading_prefix_cache:
        return
    del request.prompt_token_ids[-tokens:]
    del request._all_token_ids[-tokens:]
    request.num_prompt_tokens -= tokens
    request.max_tokens = 1


def computed_digest(request: Request) -> str:
    """:func:`p2pkv.prompt_digest.prompt_digest` of the prompt tokens this engine computed for ``request`` (its first
    ``num_computed_tokens`` prompt token ids); "" for a prompt given as embeddings (no token ids)."""
    ids = request.prompt_token_ids
    return "" if ids is None else prompt_digest(ids[:request.num_computed_tokens])
