"""Scheduler-side connector state: pulls to schedule (decode), blocks to hold (prefill)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from p2pkv.config import P2pKvConfig
from p2pkv.decode.heartbeat import HeartbeatBatch, HeartbeatSender
from p2pkv.metadata import P2pKvMetadata, PullSpec
from p2pkv.params import (
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
    ) -> None:
        self.engine_id = engine_id
        self.config = config
        self.block_size = block_size
        self.host = side_channel_host
        self.port = side_channel_port
        self.tp_size = tp_size
        self.recompute_tokens = recompute_tokens
        self.kv_groups = kv_groups
        self._pulls: list[PullSpec] = []
        self._leases: dict[str, float] = {}
        self._blocks: dict[str, tuple[int, ...]] = {}
        self._failed: dict[str, tuple[int, ...]] = {}
        self._traces: dict[str, tuple[str, int]] = {}
        self._tracing = bool(traces_endpoint(config.otlp_traces_endpoint))
        self._queued: dict[str, RemotePrefill] = {}
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
            remote = self._remote(request)
            if remote is not None:
                self._queued[request.request_id] = remote

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
    def _remote(self, request: Request, check_prompt: bool = False) -> RemotePrefill | None:
        """The request's validated pull source; None (logged, prefilled locally instead) when invalid.

        ``check_prompt``: the params must be for a prompt of this request's length. A queued
        request's params were parsed on arrival (``on_new_request``) and are not parsed again.
        """
        params = request.kv_transfer_params
        try:
            remote = self._queued.get(request.request_id)
            if remote is None:
                remote = parse_remote_prefill(params, secret=self._secret)
            prompt = len(request.prompt_token_ids or ()) - remote.appended_tokens
            if prompt < 1:
                raise KVTransferParamsError(
                    f"kv_transfer_params.appended_tokens={remote.appended_tokens} but the prompt has only "
                    f"{prompt + remote.appended_tokens} tokens: the params belong to another prompt")
            loaded = self._loaded_tokens(request, remote)
            if check_prompt and remote.num_tokens and remote.num_tokens != loaded:
                why = (f"the prefill prompt has {prompt} tokens" if loaded == prompt else
                       f"this model's prefill engine computes all but the last {prompt - loaded} of the prefill "
                       f"prompt's {prompt} tokens")
                raise KVTransferParamsError(
                    f"kv_transfer_params.remote_num_tokens={remote.num_tokens} but {why}: the params belong to "
                    "another prompt (send each prompt with its own params)")
            if len(remote.groups()) != self.kv_groups:
                raise KVTransferParamsError(
                    f"kv_transfer_params.remote_block_ids has {len(remote.groups())} KV cache group(s), this "
                    f"engine has {self.kv_groups}: run prefill and decode with the same model and the same "
                    "hybrid KV cache manager setting (--disable-hybrid-kv-cache-manager on both or neither)")
            return remote
        except KVTransferParamsError as exc:
            logger.error(
                "p2pkv: request %s: %s; prefilling it locally instead", request.request_id, exc
            )
            params["do_remote_prefill"] = False
            self._queued.pop(request.request_id, None)  # prefilled here: no more lease heartbeats for it
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens to load from the prefill engine, asynchronously: all but ``recompute_tokens``."""
        if not wants_remote_prefill(request.kv_transfer_params):
            return 0, False
        remote = self._remote(request, check_prompt=True)
        if remote is None:
            return 0, False
        count = self._loaded_tokens(request, remote) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _loaded_tokens(self, request: Request, remote: RemotePrefill) -> int:
        """Prompt tokens (from token 0) whose KV a full load leaves on this engine.

        The prefill prompt is this request's prompt less the tokens the proxy
        appended (``appended_tokens``); of it, all but ``recompute_tokens``.
        """
        prompt = len(request.prompt_token_ids or ()) - remote.appended_tokens
        return prompt - self.recompute_tokens if prompt > self.recompute_tokens else prompt

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the pull for a request whose local blocks were just allocated."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        remote = self._remote(request)
        if remote is None:
            return
        params["do_remote_prefill"] = False  # a second call (more blocks) must not pull again
        self._queued.pop(request.request_id, None)
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
            num_tokens = self._loaded_tokens(request, remote)
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
        self._queued.pop(request.request_id, None)
        if wants_remote_prefill(params):
            # Finished (aborted) before its blocks were allocated: tell the
            # prefill engine it can free its copy now.
            remote = self._remote(request)
            if remote is not None:
                params["do_remote_prefill"] = False
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
