"""Scheduler-side connector state: pulls to schedule (decode), blocks to hold (prefill)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from p2pkv.config import P2pKvConfig
from p2pkv.decode.heartbeat import HeartbeatBatch, HeartbeatSender
from p2pkv.decode.load import DecodeLoad
from p2pkv.metadata import P2pKvMetadata, PullSpec
from p2pkv.params import (
    MAX_BLOCK_IDS,
    KVTransferParamsError,
    RemotePrefill,
    make_prefill_response_params,
    parse_remote_prefill,
    sign_params,
    wants_remote_decode,
    wants_remote_prefill,
)
from p2pkv.prefill.holds import HoldEnd
from p2pkv.prefill.spans import emit_hold_span
from p2pkv.telemetry.tracing import TRACEPARENT_KEY, Tracing, parse_traceparent, traces_endpoint

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

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
            :func:`p2pkv.compat.frees_blocks_behind_window`). Also 1 for a
            model with Mamba/SSM state: the state moved is the one after
            ``N - 1`` tokens, and the decode step over the last token
            advances it (:func:`p2pkv.compat.recompute_tokens`).
        kv_groups: KV cache groups of this engine (vLLM's hybrid KV cache
            manager, HMA, gives a model with several attention types one
            group per type; 1 otherwise). With more than one, a pull pairs
            each group's blocks with the prefill engine's of the same group,
            block for block (both engines use one block size).
        max_blocks: most block ids per KV cache group that params may name (a
            request's params naming more are refused before their ids are read):
            this engine's ``max_model_len`` in tokens, which bounds the blocks of
            its longest prompt whatever the prefill engine's block size.
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
    ) -> None:
        self.engine_id = engine_id
        self.config = config
        self.block_size = block_size
        self.host = side_channel_host
        self.port = side_channel_port
        self.tp_size = tp_size
        self.recompute_tokens = recompute_tokens
        self.kv_groups = kv_groups
        self.max_blocks = max_blocks
        self._pulls: list[PullSpec] = []
        self._leases: dict[str, float] = {}
        self._blocks: dict[str, tuple[int, ...]] = {}
        self._failed: dict[str, tuple[int, ...]] = {}
        self._traces: dict[str, tuple[str, int]] = {}
        self._tracing = bool(traces_endpoint(config.otlp_traces_endpoint))
        self._queued: dict[str, RemotePrefill] = {}  # decode requests waiting, for lease heartbeats
        self._loads: dict[str, DecodeLoad] = {}  # checked once, kept until allocated or finished
        self._next_heartbeat = 0.0
        self._secret = config.secret_bytes()  # signs the params this engine hands out, checks those it gets
        self.heartbeats = HeartbeatSender(engine_id, self._secret, timeout_s=min(1.0, config.handshake_timeout_s))

    # ---- on arrival: the prefill side's tail, the decode side's heartbeats ----
    def on_new_request(self, request: Request) -> None:
        """Leave a prefill request's last ``recompute_tokens`` to the decode engine; track a decode
        request whose KV waits on a prefill engine, for heartbeats."""
        if self.recompute_tokens and wants_remote_decode(request.kv_transfer_params):
            self._leave_tail_to_decode(request)
        if wants_remote_prefill(request.kv_transfer_params) and self.config.heartbeat_every_s > 0:
            try:
                self._queued[request.request_id] = parse_remote_prefill(request.kv_transfer_params,
                                                                        secret=self._secret,
                                                                        max_blocks=self.max_blocks)
            except KVTransferParamsError as exc:
                self._refuse(request, exc)

    def _leave_tail_to_decode(self, request: Request) -> None:
        """Drop the prompt's last ``recompute_tokens`` tokens from a request prefilled for a decode engine.

        The decode engine computes them (see ``recompute_tokens``); the request
        then ends after one sampled token, which no client should read (the
        proxy takes only ``kv_transfer_params`` from the prefill engine). A
        request that skips the prefix cache (prompt logprobs) is left whole:
        the decode engine then refuses its params and prefills it itself.
        """
        n = self.recompute_tokens
        if request.prompt_token_ids is None or request.num_prompt_tokens <= n or request.skip_reading_prefix_cache:
            return
        del request.prompt_token_ids[-n:]
        del request._all_token_ids[-n:]
        request.num_prompt_tokens -= n
        request.max_tokens = 1

    def send_heartbeats(self, now: float | None = None) -> int:
        """Every ``heartbeat_every_s``: extend the prefill leases of queued requests.

        Returns:
            The number of batches queued for sending (one per prefill rank).
        """
        now = time.monotonic() if now is None else now
        if not self._queued or now < self._next_heartbeat:
            return 0
        self._next_heartbeat = now + self.config.heartbeat_every_s
        by_peer: dict[tuple[str, str, int, int], list[str]] = {}
        for remote in self._queued.values():
            key = (remote.engine_id, remote.host, remote.port, remote.tp_size)
            by_peer.setdefault(key, []).append(remote.request_id)
        batches = 0
        for (engine_id, host, port, tp_size), ids in by_peer.items():
            for rank in range(tp_size):
                self.heartbeats.submit(HeartbeatBatch(host, port + rank, tuple(ids), self.config.lease_s,
                                                      engine_id, rank))
                batches += 1
        return batches

    # ---- decode side -------------------------------------------------
    def _check(self, request: Request) -> DecodeLoad | None:
        """The request's :class:`DecodeLoad` from its params, checked (the capability's HMAC and expiry
        included; a queued request's params were parsed and checked on arrival and are not parsed again);
        None (logged, prefilled locally instead) when they are refused."""
        try:
            remote = self._queued.get(request.request_id)
            if remote is None:
                remote = parse_remote_prefill(request.kv_transfer_params, secret=self._secret,
                                              max_blocks=self.max_blocks)
            return DecodeLoad.of(remote, len(request.prompt_token_ids or ()), self.recompute_tokens, self.kv_groups)
        except KVTransferParamsError as exc:
            self._refuse(request, exc)
            return None

    def _refuse(self, request: Request, exc: KVTransferParamsError) -> None:
        """Params refused: logged, and the request prefilled locally instead."""
        logger.error("p2pkv: request %s: %s; prefilling it locally instead", request.request_id, exc)
        request.kv_transfer_params["do_remote_prefill"] = False
        self._queued.pop(request.request_id, None)  # prefilled here: no more lease heartbeats for it

    def _load(self, request: Request) -> DecodeLoad | None:
        """The request's :class:`DecodeLoad`: the one kept since it was first checked, else checked now and
        kept until its blocks are allocated or it finishes; None when its params are refused."""
        load = self._loads.get(request.request_id)
        if load is None and (load := self._check(request)) is not None:
            self._loads[request.request_id] = load
        return load

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens to load from the prefill engine, asynchronously: all but ``recompute_tokens``.

        The first call for a request checks its params and keeps the outcome
        (:class:`p2pkv.decode.load.DecodeLoad`); later calls and
        :meth:`update_state_after_alloc` use what it kept and check nothing again.
        """
        if not wants_remote_prefill(request.kv_transfer_params):
            return 0, False
        load = self._load(request)
        if load is None:
            return 0, False
        count = load.loaded_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the pull for a request whose local blocks were just allocated.

        Uses the :class:`~p2pkv.decode.load.DecodeLoad` kept by
        :meth:`get_num_new_matched_tokens` as it is (no check is made again);
        without one the load is reported failed (:meth:`fail_load`: its blocks
        as load errors), never left unanswered.
        """
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # a second call (more blocks) must not pull again
        self._queued.pop(request.request_id, None)
        load = self._loads.pop(request.request_id, None)
        if load is None:
            logger.error("p2pkv: request %s: blocks allocated for a load that was never checked; its load fails",
                         request.request_id)
            self.fail_load(request, blocks, num_external_tokens)
            return
        remote = load.remote
        if self.kv_groups > 1:
            local, remote_ids = group_pairs(remote, blocks) if num_external_tokens > 0 else ((), ())
            first_token, num_tokens = 0, -1  # the lists already pair up block for block
        else:
            local, remote_ids, first_token = (), (), 0
            if num_external_tokens > 0:
                # Blocks before the attention window are vLLM's null block (a sliding
                # window frees them): they are skipped, like the locally cached prefix.
                all_ids = list(blocks.get_block_ids()[0])
                local = tuple(blocks.get_unhashed_block_ids_all_groups()[0])
                first_token = (len(all_ids) - len(local)) * self.block_size
                # The whole remote list goes along: the worker maps tokens to blocks once
                # it knows the prefill engine's block size (it may differ from ours).
                remote_ids = tuple(remote.block_ids) if local else ()
            num_tokens = load.loaded_tokens
        self._pulls.append(
            PullSpec(
                request_id=request.request_id,
                local_block_ids=tuple(local),
                remote_block_ids=tuple(remote_ids),
                remote=remote,
                report=num_external_tokens > 0,
                first_token=first_token,
                num_tokens=num_tokens,
                arrival=float(getattr(request, "arrival_time", 0.0) or 0.0),
                scheduled=time.time(),
                traceparent=(parse_traceparent(params.get(TRACEPARENT_KEY)) or "") if self._tracing else "",
            )
        )

    def fail_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """A pull that could not be set up: the workers report it failed (its blocks as load errors)."""
        self._loads.pop(request.request_id, None)
        if isinstance(request.kv_transfer_params, dict):
            request.kv_transfer_params["do_remote_prefill"] = False
        if num_external_tokens > 0:
            try:
                ids = tuple(b for group in blocks.get_unhashed_block_ids_all_groups() for b in group)
            except Exception:
                ids = ()
            self._failed[request.request_id] = ids

    # ---- both ----------------------------------------------------------
    def build_connector_meta(self) -> P2pKvMetadata:
        """Hand this step's new pulls and leases to the workers, then forget them."""
        try:
            self.send_heartbeats()
        except Exception:  # heartbeats are best effort; the step's pulls must reach the workers
            logger.exception("p2pkv: sending lease heartbeats failed")
        meta = P2pKvMetadata(pulls=self._pulls, send_leases=self._leases, send_blocks=self._blocks,
                             failed=self._failed, send_traces=self._traces)
        self._pulls, self._leases, self._blocks, self._failed, self._traces = [], {}, {}, {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished_all_groups` for an engine with one KV cache group."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Hold a prefilled request's blocks (every KV cache group's) for a decode engine and say where they are.

        Args:
            request: the finished request.
            block_ids: its block ids per KV cache group, in token order (a
                sliding-window group's blocks behind the window are vLLM's
                null block, id 0).

        Returns:
            ``(hold, params)``: ``hold`` is True when the blocks stay allocated
            until the decode side's notification or the lease (``lease_s``)
            ends; ``params`` are the NixlConnector-compatible
            ``kv_transfer_params`` for the decode engine.
        """
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        queued = self._queued.pop(request.request_id, None)
        load = self._loads.pop(request.request_id, None)  # kept no longer, whatever the request's end
        if wants_remote_prefill(params):
            # Finished (aborted) before its blocks were allocated: tell the
            # prefill engine it can free its copy now.
            params["do_remote_prefill"] = False
            remote = load.remote if load is not None else queued or self._source_of_unloaded(request)
            if remote is not None:
                self._pulls.append(PullSpec(request.request_id, (), (), remote, report=False))
            return False, None
        if not wants_remote_decode(params):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self._trace_aborted(request, params)
            return False, None  # aborted on the prefill side: free the blocks now
        flat = tuple(b for group in block_ids for b in group)
        if not any(flat):
            return False, None
        self._leases[request.request_id] = time.monotonic() + self.config.lease_s
        self._blocks[request.request_id] = flat
        if self._tracing and (trace := parse_traceparent(params.get(TRACEPARENT_KEY))):
            self._traces[request.request_id] = (trace, time.time_ns())
        expiry = time.time() + self.config.lease_s
        answer = make_prefill_response_params(
            engine_id=self.engine_id,
            request_id=request.request_id,
            host=self.host,
            port=self.port,
            block_ids=flat,
            group_sizes=tuple(len(g) for g in block_ids) if len(block_ids) > 1 else (),
            tp_size=self.tp_size,
            num_tokens=request.num_computed_tokens,
            expiry_time=expiry,
            first_token=self.recompute_tokens == 0,
        )
        return True, (sign_params(answer, self._secret, expiry) if self._secret else answer)

    def _source_of_unloaded(self, request: Request) -> RemotePrefill | None:
        """Where a request that finished before its params were first checked would have loaded from; None
        (logged) when its params are refused: its prefill engine's lease frees the hold then."""
        try:
            return parse_remote_prefill(request.kv_transfer_params, secret=self._secret, max_blocks=self.max_blocks)
        except KVTransferParamsError as exc:
            logger.warning("p2pkv: request %s finished before its load; its params are refused (%s), so its "
                           "prefill engine is not told to free it now (its lease frees it)", request.request_id, exc)
            return None

    def _trace_aborted(self, request: Request, params: dict[str, Any]) -> None:
        """A request aborted on the prefill engine ends its hold before it began: a ``p2pkv.hold`` span of no
        length, ended ``aborted`` (with tracing on and a trace context in its params)."""
        if self._tracing and (trace := parse_traceparent(params.get(TRACEPARENT_KEY))):
            tracing = Tracing.get("p2pkv-prefill", traces_endpoint(self.config.otlp_traces_endpoint))
            if tracing is not None:
                emit_hold_span(tracing, request.request_id, trace, time.time_ns(), HoldEnd.ABORTED, self.engine_id,
                               None, 0)

    def shutdown(self) -> None:
        """Stop the heartbeat thread. Idempotent."""
        self.heartbeats.close()


def group_pairs(remote: RemotePrefill, blocks: KVCacheBlocks) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_ids, remote_ids)`` paired block for block over every KV cache group (one block size on both sides).

    Each group's ``i``-th block holds the same tokens on both engines. A
    local block is paired when it is newly allocated (not a prefix-cache hit,
    not vLLM's null block) and the prefill engine's block at its position
    exists and is not the null block (id 0: behind a sliding window, freed):
    so for a sliding-window group only the blocks inside the window move.
    The groups' pairs are concatenated; HMA groups share one block pool and
    their layers share the KV tensors, so a block id names the same pages
    for every layer that the worker registered.
    """
    local_out: list[int] = []
    remote_out: list[int] = []
    for all_ids, new_ids, theirs in zip(blocks.get_block_ids(), blocks.get_unhashed_block_ids_all_groups(),
                                        remote.groups(), strict=True):
        start = len(all_ids) - len(new_ids)  # position of the first newly allocated block
        for i, local_id in enumerate(new_ids, start):
            if i < len(theirs) and theirs[i] != 0:
                local_out.append(local_id)
                remote_out.append(theirs[i])
    return tuple(local_out), tuple(remote_out)
