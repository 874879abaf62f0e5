"""Scheduler-side connector state: a thin facade over the decode half (:mod:`p2pkv.scheduling.load_scheduling`: which
requests load, and their pulls) and the prefill half (:mod:`p2pkv.scheduling.hold_scheduling`: which requests hold their
blocks, and the params that say where)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from p2pkv.config import ConfigError, P2pKvConfig, Role
from p2pkv.grant import STREAMED_KEY, wants_stream
from p2pkv.metadata import P2pKvMetadata
from p2pkv.params import MAX_BLOCK_IDS, wants_remote_decode, wants_remote_prefill
from p2pkv.scheduling.hold_scheduling import PrefillScheduling
from p2pkv.scheduling.load_scheduling import DecodeScheduling, group_pairs
from p2pkv.scheduling.stream_steps import StreamSteps
from p2pkv.telemetry.tracing import traces_endpoint
from p2pkv.turns import mark_loaded, wants_load

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["SchedulerSide", "group_pairs"]

logger = logging.getLogger("p2pkv.scheduler")


class SchedulerSide:
    """The connector's scheduler-side half.

    Args:
        engine_id: this engine's id (returned to decode engines).
        config: p2pkv settings.
        block_size: tokens per block of this engine.
        side_channel_host: host decode engines reach this engine's side channel on.
        side_channel_port: base side-channel port of this engine (rank 0).
        tp_size: this engine's tensor-parallel size.
        recompute_tokens: trailing prompt tokens the decode engine computes
            itself instead of loading (tokens). 1 when vLLM frees blocks
            behind an attention window (sliding-window or chunked-local
            attention): both engines place the window by the tokens computed
            or loaded, and with all ``N`` counted they free the block of token
            ``N - window``, which the last prompt token attends to. A prefill
            engine with it computes all but the last ``recompute_tokens``
            prompt tokens of a request it prefills for a decode engine; a
            decode engine loads that many (see
            :func:`p2pkv.engine_facts.frees_blocks_behind_window`). Also 1 for a
            model with Mamba/SSM state: the state moved is the one after
            ``N - 1`` tokens, and the decode step over the last token
            advances it (:func:`p2pkv.engine_facts.recompute_tokens`).
        kv_groups: KV cache groups of this engine (vLLM's hybrid KV cache
            manager, HMA, gives a model with several attention types one
            group per type; 1 otherwise). With more than one, a pull pairs
            each group's blocks with the prefill engine's of the same group,
            block for block (both engines use one block size).
        max_blocks: most block ids per KV cache group that params may name (a
            request's params naming more are refused before their ids are read):
            this engine's ``max_model_len`` in tokens, which bounds the blocks of
            its longest prompt whatever the prefill engine's block size.
        role: what this engine does (:func:`p2pkv.config.engine_role`): a ``decode`` engine holds no blocks
            for other engines.
        num_blocks: blocks of this engine's KV cache (caps the blocks held for remote decodes at
            ``max_held_fraction`` of them; None: no cap).
        state_groups: the indices of its KV cache groups that hold Mamba/SSM state
            (:func:`p2pkv.engine_facts.state_group_indices`): a stream sends their blocks after the prompt's last step.
        clock: monotonic seconds of the holds' leases (``time.monotonic``; tests pass a fake).
        pp_size: this engine's pipeline-parallel size: its answers name it (``pp_size``); each stage's workers
            stream their own layers.
    """

    def __init__(
        self,
        engine_id: str,
        config: P2pKvConfig,
        block_size: int,
        side_channel_host: str,
        side_channel_port: int,
        tp_size: int,
        recompute_tokens: int = 0,
        kv_groups: int = 1,
        max_blocks: int = MAX_BLOCK_IDS,
        role: Role = "both",
        num_blocks: int | None = None,
        state_groups: frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
        pp_size: int = 1,
    ) -> None:
        if config.keep_turns_s and role != "both":
            raise ConfigError(f"keep_turns_s={config.keep_turns_s:g} needs role both, and this engine's role is "
                              f"{role} (from vLLM's kv_role): set role both on the engines of a multi-turn "
                              "deployment (each keeps turns for the other and loads from it)")
        self.engine_id = engine_id
        self.config = config
        self.role = role
        self._told_prefill_loads = False  # a load asked of this prefill engine was logged
        secret = config.secret_bytes()  # signs the params this engine hands out, checks those it gets
        tracing = bool(traces_endpoint())
        self.decode = DecodeScheduling(engine_id, config, block_size, secret, recompute_tokens, kv_groups,
                                       max_blocks, tracing)
        self.prefill = PrefillScheduling(engine_id, config, role, side_channel_host, side_channel_port, tp_size,
                                         secret, recompute_tokens, num_blocks, clock, pp_size)
        self.streams = StreamSteps(engine_id, secret, block_size, recompute_tokens, kv_groups, state_groups,
                                   ledger=self.prefill.ledger, max_lifetime_s=config.max_lifetime_s, pp_size=pp_size)

    def on_new_request(self, request: Request) -> None:
        """A request arrives: a prefill leg leaves its tail to the decode engine, a decode leg is tracked for
        lease heartbeats. A ``prefill`` engine loads nothing (its workers build no Receiver): a request whose
        params ask it to load KV (``do_remote_prefill``) has its prompt computed here, as an aggregated engine
        would, and the first such request is logged naming the fix."""
        self._load_nothing_on_prefill(request)
        self.prefill.on_new_request(request)
        self.decode.on_new_request(request)
        params = request.kv_transfer_params
        if self.role != "decode" and wants_remote_decode(params) and wants_stream(params):
            self.streams.on_new_request(request)

    def send_heartbeats(self, now: float | None = None) -> int:
        """See :meth:`p2pkv.scheduling.load_scheduling.DecodeScheduling.send_heartbeats`."""
        return self.decode.send_heartbeats(now)

    def _load_nothing_on_prefill(self, request: Request) -> None:
        """On a ``prefill`` engine, a request that asks to load KV (a decode leg's, or a kept turn's) is computed here
        (no load, no heartbeats)."""
        if self.role == "prefill" and wants_load(request.kv_transfer_params):
            mark_loaded(request.kv_transfer_params)
            if not self._told_prefill_loads:
                self._told_prefill_loads = True
                logger.warning("p2pkv: request %s asks this prefill engine (role prefill) to load KV "
                               "(do_remote_prefill, or a kept turn's remote_block_ids): it computes the prompt "
                               "itself; send decode legs to a decode engine (role decode or both), and run a "
                               "multi-turn deployment's engines with role both. Further such requests are not "
                               "logged.", request.request_id[:64])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """See :meth:`p2pkv.scheduling.load_scheduling.DecodeScheduling.get_num_new_matched_tokens` (a ``prefill``
        engine loads nothing: :meth:`on_new_request`)."""
        self._load_nothing_on_prefill(request)
        return self.decode.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """See :meth:`p2pkv.scheduling.load_scheduling.DecodeScheduling.update_state_after_alloc`."""
        self.decode.update_state_after_alloc(request, blocks, num_external_tokens)

    def fail_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """See :meth:`p2pkv.scheduling.load_scheduling.DecodeScheduling.fail_load`."""
        self.decode.fail_load(request, blocks, num_external_tokens)

    def on_sent(self, request_ids: set[str] | frozenset[str]) -> None:
        """The workers released these requests' holds (vLLM frees their blocks now)."""
        self.prefill.on_sent(request_ids)

    def build_connector_meta(self, scheduler_output: Any = None) -> P2pKvMetadata:
        """Hand this step's new pulls, leases and stream chunks to the workers, then forget them
        (``scheduler_output``: vLLM's ``SchedulerOutput`` of the step; None: no stream chunks)."""
        try:
            self.decode.send_heartbeats()
        except Exception:  # heartbeats are best effort; the step's pulls must reach the workers
            logger.exception("p2pkv: sending lease heartbeats failed")
        pulls, failed = self.decode.take()
        leases, blocks, traces = self.prefill.take()
        chunks = self.streams.chunks(scheduler_output) if scheduler_output is not None else []
        admits, refusals = self.streams.take_admits()
        return P2pKvMetadata(loads=pulls, send_leases=leases, send_blocks=blocks, failed=failed,
                             send_traces=traces, streams=chunks, stream_aborts=self.streams.take_aborts(),
                             stream_restarts=self.streams.take_restarts(),
                             ended_streams=self.decode.take_ended_streams(), stream_admits=admits,
                             stream_refusals=refusals)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished_all_groups` for an engine with one KV cache group."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """A request ends: a decode leg drops what was kept for it (see
        :meth:`p2pkv.scheduling.load_scheduling.DecodeScheduling.request_finished`) and, with ``keep_turns_s``,
        may keep its blocks for the conversation's next turn (see
        :meth:`p2pkv.scheduling.hold_scheduling.PrefillScheduling.keep_turn`); a prefill leg may hold its blocks
        (every KV cache group's) for a decode engine (see
        :meth:`p2pkv.scheduling.hold_scheduling.PrefillScheduling.request_finished`).

        Returns:
            ``(hold, params)`` as vLLM's ``request_finished`` expects.
        """
        from vllm.v1.request import RequestStatus

        remote_prefill = wants_remote_prefill(request.kv_transfer_params)
        self.decode.request_finished(request)
        finished = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if remote_prefill or not wants_remote_decode(request.kv_transfer_params):
            if self.config.keep_turns_s and request.kv_transfer_params and _answered_whole(request):
                # a decode leg answered whole (a streamed answer carries no params): kept for the next turn
                return self.prefill.keep_turn(request, block_ids, not remote_prefill and request.status in finished)
            return False, None
        completed = request.status in finished
        streamed = self.streams.finished(request.request_id, completed)
        hold, answer = self.prefill.request_finished(request, block_ids, completed, streamed=streamed,
                                                     refusal=self.streams.refusal(request.request_id))
        if streamed and answer is not None and hold:
            answer[STREAMED_KEY] = True  # the proxy's word that the stream ran under its grant
        return hold, answer

    def shutdown(self) -> None:
        """Stop the heartbeat thread. Idempotent."""
        self.decode.shutdown()


def _answered_whole(request: Request) -> bool:
    """vLLM's answer to ``request`` carries its ``kv_transfer_params`` (those that name a kept turn): not a streamed
    HTTP answer (``RequestOutputKind.DELTA``), whose chunks carry none."""
    from vllm.sampling_params import RequestOutputKind

    sampling = request.sampling_params
    return sampling is None or sampling.output_kind is not RequestOutputKind.DELTA
