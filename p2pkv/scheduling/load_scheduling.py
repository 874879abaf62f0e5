"""The decode half of the connector's scheduler side: which requests load their prompt's KV from a prefill
engine, checked once (:class:`p2pkv.scheduling.load.DecodeLoad`), and the pulls the workers are told to make.

A capability (or a stream grant) serves one request on this engine for its whole life: the first request whose
checked params carry it (or, without a secret, name a hold: its engine, request, host and port) or a stream id
binds it
(:class:`p2pkv.bindings.Bindings`, until the capability or grant expires); any later request naming it (params
replayed by whoever saw them: a log, a trace, the proxy → engine hop) is refused before anything is allocated
for it, logged, and prefilled here. A replayed stream grant is not declined to its prefill rank: that would
stop the stream of the request it serves.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from handshake import GroupBlocks
from p2pkv.bindings import Bindings
from p2pkv.config import P2pKvConfig
from p2pkv.grant import parse_stream_leg, wants_stream
from p2pkv.metadata import LoadSpec
from p2pkv.params import (
    CAPABILITY_KEY,
    CLOCK_SKEW_S,
    KVTransferParamsError,
    RemotePrefill,
    parse_remote_prefill,
    wants_remote_prefill,
)
from p2pkv.scheduling.heartbeat import HeartbeatBatch, HeartbeatSender
from p2pkv.scheduling.load import DecodeLoad
from p2pkv.telemetry.tracing import TRACEPARENT_KEY, parse_traceparent
from p2pkv.turns import mark_loaded, wants_load, wants_turn_load

logger = logging.getLogger("p2pkv.scheduler")

Request = Any
"""vLLM's ``vllm.v1.request.Request`` (this package does not import vLLM; :mod:`p2pkv.scheduler` does)."""
KVCacheBlocks = Any
"""vLLM's ``vllm.v1.core.kv_cache_manager.KVCacheBlocks``."""


class DecodeScheduling:
    """Loads from prefill engines, from a request's arrival to its pull handed to the workers.

    Args:
        engine_id: this engine's id (named in lease heartbeats).
        config: p2pkv settings (``heartbeat_every_s``, ``lease_s``, timeouts, tracing).
        block_size: tokens per block of this engine.
        secret: checks the params' capability (None: an insecure deployment).
        recompute_tokens: trailing prompt tokens this engine computes itself instead of loading (tokens).
        kv_groups: KV cache groups of this engine.
        max_blocks: most block ids per KV cache group that params may name (this engine's ``max_model_len``).
        tracing: whether pulls carry their decode leg's trace context.
    """

    def __init__(self, engine_id: str, config: P2pKvConfig, block_size: int, secret: bytes | None,
                 recompute_tokens: int, kv_groups: int, max_blocks: int, tracing: bool) -> None:
        self.engine_id = engine_id
        self.config = config
        self.block_size = block_size
        self.recompute_tokens = recompute_tokens
        self.kv_groups = kv_groups
        self.max_blocks = max_blocks
        self._secret = secret
        self._tracing = tracing
        self.transfers: list[LoadSpec] = []
        self.failed: dict[str, tuple[int, ...]] = {}
        self._queued: dict[str, RemotePrefill] = {}  # decode requests waiting, for lease heartbeats
        self._loads: dict[str, DecodeLoad] = {}  # checked once, kept until allocated or finished
        self._streaming: set[str] = set()  # streamed loads handed to the workers, until their request finishes
        self._ended_streams: list[str] = []  # of those, the ones finished since the last step
        self._next_heartbeat = 0.0
        self.bound = Bindings("capability")  # a capability → the decode request it serves
        self.bound_streams = Bindings("stream id")
        self.heartbeats = HeartbeatSender(engine_id, secret, timeout_s=min(1.0, config.handshake_timeout_s))

    def take(self) -> tuple[list[LoadSpec], dict[str, tuple[int, ...]]]:
        """This step's new pulls and failed loads (for the workers), then forgotten."""
        out = self.transfers, self.failed
        self.transfers, self.failed = [], {}
        return out

    def take_ended_streams(self) -> list[str]:
        """Requests whose streamed load the workers were given and that have finished since the last call (a
        stream still under way is given up: the request was aborted while it ran), then forgotten."""
        out, self._ended_streams = self._ended_streams, []
        return out

    def on_new_request(self, request: Request) -> None:
        """Track a request whose KV waits on a prefill engine, for lease heartbeats (its params checked now)."""
        params = request.kv_transfer_params
        if wants_load(params) and not (wants_remote_prefill(params) and wants_stream(params)):
            try:
                self._queued[request.request_id] = self._parse(request)
            except KVTransferParamsError as exc:
                self._refuse(request, exc)

    def send_heartbeats(self, now: float | None = None) -> int:
        """Every ``heartbeat_every_s``: extend the prefill leases of queued requests.

        Returns:
            The number of batches queued for sending (one per prefill worker: every tensor-parallel rank of every
            pipeline stage holds the blocks).
        """
        now = time.monotonic() if now is None else now
        if not self._queued or now < self._next_heartbeat:
            return 0
        self._next_heartbeat = now + self.config.heartbeat_every_s
        by_peer: dict[tuple[str, str, int, int], list[str]] = {}
        for remote in self._queued.values():
            key = (remote.engine_id, remote.host, remote.port, remote.num_ranks)
            by_peer.setdefault(key, []).append(remote.request_id)
        batches = 0
        for (engine_id, host, port, num_ranks), ids in by_peer.items():
            for rank in range(num_ranks):
                self.heartbeats.submit(HeartbeatBatch(host, port + rank, tuple(ids), self.config.lease_s,
                                                      engine_id, rank))
                batches += 1
        return batches

    def _parse(self, request: Request) -> RemotePrefill:
        """The request's params, parsed and their capability checked (expiry within ``max_lifetime_s``, then this
        engine's KV cache group count and ``max_blocks``, then the MAC, then the ids). Raises
        KVTransferParamsError."""
        return parse_remote_prefill(request.kv_transfer_params, secret=self._secret, max_blocks=self.max_blocks,
                                    kv_groups=self.kv_groups, max_lifetime_s=self.config.max_lifetime_s)

    def _check(self, request: Request) -> DecodeLoad | None:
        """The request's :class:`DecodeLoad` from its params, checked (the capability's HMAC and expiry
        included; a queued request's params were parsed and checked on arrival and are not parsed again);
        None (logged, prefilled locally instead) when they are refused."""
        try:
            params = request.kv_transfer_params
            if wants_stream(params) and not wants_turn_load(params):
                remote, grant = parse_stream_leg(params, self._secret, decode_engine_id=self.engine_id,
                                                 now=time.time(), max_lifetime_s=self.config.max_lifetime_s)
                try:
                    load = DecodeLoad.streamed(remote, grant, request.prompt_token_ids or (), self.recompute_tokens)
                except KVTransferParamsError:
                    self._decline(request.request_id, remote, grant)
                    raise
                self._bind(self.bound_streams, remote.request_id, request.request_id, int(grant.split(".")[2]))
                return load
            remote = self._queued.get(request.request_id)
            if remote is None:
                remote = self._parse(request)
            if wants_turn_load(params):
                load = self._turn(request, remote)
            else:
                load = DecodeLoad.of(remote, request.prompt_token_ids or (), self.recompute_tokens, self.kv_groups)
            self._bind(self.bound, _capability_key(params, remote), request.request_id,
                       _capability_expiry(params, time.time() + self.config.max_lifetime_s))
            return load
        except KVTransferParamsError as exc:
            self._refuse(request, exc)
            return None

    def _turn(self, request: Request, remote: RemotePrefill) -> DecodeLoad:
        """The load of a kept turn into this prefill leg (:meth:`DecodeLoad.turn`); one that does not apply (the
        conversation changed) tells the engine that kept it to free it now: its conversation moved on.

        Raises:
            KVTransferParamsError: as :meth:`DecodeLoad.turn`.
        """
        try:
            return DecodeLoad.turn(remote, request.prompt_token_ids or (), self.kv_groups)
        except KVTransferParamsError:
            self.transfers.append(LoadSpec(request.request_id, (), (), remote, report=False))
            raise

    def _bind(self, bound: Bindings, key: str, request_id: str, expiry: float) -> None:
        """Bind ``key`` to ``request_id`` until ``expiry`` (``time.time()`` seconds, plus the clock skew allowed).

        Raises:
            KVTransferParamsError: ``key`` already serves another request here (a replay), or too many are bound.
        """
        if (why := bound.bind(key, request_id, expiry + CLOCK_SKEW_S, time.time())) is not None:
            raise KVTransferParamsError(f"kv_transfer_params refused: {why}")

    def _decline(self, request_id: str, remote: RemotePrefill, grant: str) -> None:
        """A stream (its grant checked) this engine will not take: a load of nothing, which tells the prefill rank
        at once to stop the stream and free its hold (it would hold the blocks until its lease)."""
        self.transfers.append(LoadSpec(request_id, (), (), remote, report=False, stream_grant=grant))

    def _refuse(self, request: Request, exc: KVTransferParamsError) -> None:
        """Params refused: logged, and the request prefilled locally instead."""
        logger.error("p2pkv: request %s: %s; prefilling it locally instead", request.request_id, exc)
        mark_loaded(request.kv_transfer_params)
        self._queued.pop(request.request_id, None)  # prefilled here: no more lease heartbeats for it

    def _load(self, request: Request) -> DecodeLoad | None:
        """The request's :class:`DecodeLoad`: the one kept since it was first checked, else checked now and
        kept until its blocks are allocated or it finishes; None when its params are refused."""
        load = self._loads.get(request.request_id)
        if load is None and (load := self._check(request)) is not None:
            self._loads[request.request_id] = load
        return load

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens to load from the prefill engine, asynchronously: all but ``recompute_tokens``; for a
        prefill leg that reuses a kept turn, the kept tokens.

        The first call for a request checks its params and keeps the outcome
        (:class:`p2pkv.scheduling.load.DecodeLoad`); later calls and
        :meth:`update_state_after_alloc` use what it kept and check nothing again.
        """
        if not wants_load(request.kv_transfer_params):
            return 0, False
        load = self._load(request)
        if load is None:
            return 0, False
        count = load.loaded_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Record the pull for a request whose local blocks were just allocated.

        Uses the :class:`~p2pkv.scheduling.load.DecodeLoad` kept by
        :meth:`get_num_new_matched_tokens` as it is (no check is made again);
        without one the load is reported failed (:meth:`fail_load`: its blocks
        as load errors), never left unanswered.
        """
        params = request.kv_transfer_params
        if not wants_load(params):
            return
        mark_loaded(params)  # a second call (more blocks) must not pull again
        self._queued.pop(request.request_id, None)
        load = self._loads.pop(request.request_id, None)
        if load is None:
            logger.error("p2pkv: request %s: blocks allocated for a load that was never checked; its load fails",
                         request.request_id)
            self.fail_load(request, blocks, num_external_tokens)
            return
        remote = load.remote
        stream_groups: tuple[GroupBlocks, ...] = ()
        if self.kv_groups > 1 and load.grant:
            stream_groups = streamed_groups(blocks) if num_external_tokens > 0 else ()
            local = tuple(b for group in stream_groups for b in group.block_ids)
            remote_ids, first_token, num_tokens = (), 0, load.loaded_tokens
        elif self.kv_groups > 1:
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
        if load.grant and num_external_tokens > 0:
            self._streaming.add(request.request_id)
        self.transfers.append(LoadSpec(
            request_id=request.request_id, local_block_ids=tuple(local), remote_block_ids=tuple(remote_ids),
            remote=remote, report=num_external_tokens > 0, first_token=first_token, num_tokens=num_tokens,
            arrival=float(getattr(request, "arrival_time", 0.0) or 0.0), scheduled=time.time(),
            traceparent=(parse_traceparent(params.get(TRACEPARENT_KEY)) or "") if self._tracing else "",
            stream_grant=load.grant, stream_groups=stream_groups))

    def fail_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """A pull that could not be set up: the workers report it failed (its blocks as load errors)."""
        self._loads.pop(request.request_id, None)
        if isinstance(request.kv_transfer_params, dict):
            mark_loaded(request.kv_transfer_params)
        if num_external_tokens > 0:
            try:
                ids = tuple(b for group in blocks.get_unhashed_block_ids_all_groups() for b in group)
            except Exception:
                ids = ()
            self.failed[request.request_id] = ids

    def request_finished(self, request: Request) -> None:
        """A request ends: what was kept for it is dropped; one that ended (aborted) before its blocks were
        allocated tells its prefill engine to free its copy now (a notify-only pull; for a stream, a declined
        one); one whose stream was handed to the workers is named to them (:meth:`take_ended_streams`)."""
        queued = self._queued.pop(request.request_id, None)
        load = self._loads.pop(request.request_id, None)  # kept no longer, whatever the request's end
        if request.request_id in self._streaming:  # its stream may still run (aborted while waiting for it)
            self._streaming.discard(request.request_id)
            self._ended_streams.append(request.request_id)
        params = request.kv_transfer_params
        if wants_remote_prefill(params) and wants_stream(params):
            params["do_remote_prefill"] = False
            if load is not None:
                self._decline(request.request_id, load.remote, load.grant)
                return
            with contextlib.suppress(KVTransferParamsError):  # refused: the prefill engine's lease ends the stream
                self._decline(request.request_id, *parse_stream_leg(
                    params, self._secret, decode_engine_id=self.engine_id, now=time.time(),
                    max_lifetime_s=self.config.max_lifetime_s))
        elif wants_load(params):
            mark_loaded(params)
            remote = load.remote if load is not None else queued or self._source_of_unloaded(request)
            if remote is not None:
                self.transfers.append(LoadSpec(request.request_id, (), (), remote, report=False))

    def _source_of_unloaded(self, request: Request) -> RemotePrefill | None:
        """Where a request that finished before its params were first checked would have loaded from; None
        (logged) when its params are refused: its prefill engine's lease frees the hold then."""
        try:
            return self._parse(request)
        except KVTransferParamsError as exc:
            logger.warning("p2pkv: request %s finished before its load; its params are refused (%s), so its "
                           "prefill engine is not told to free it now (its lease frees it)", request.request_id, exc)
            return None

    def shutdown(self) -> None:
        """Stop the heartbeat thread. Idempotent."""
        self.heartbeats.close()


def _capability_key(params: dict[str, Any], remote: RemotePrefill) -> str:
    """What a load's binding is keyed by: its capability (the MAC names everything the params say), or, without
    one (an insecure deployment), where the hold is and which request it is."""
    capability = params.get(CAPABILITY_KEY)
    if isinstance(capability, str):
        return capability
    return f"{remote.engine_id}/{remote.request_id}@{remote.host}:{remote.port}"


def _capability_expiry(params: dict[str, Any], default: float) -> float:
    """The expiry (``time.time()`` seconds) of checked params' capability, or ``default`` without one (an
    insecure deployment)."""
    capability = params.get(CAPABILITY_KEY)
    if not isinstance(capability, str):
        return default
    return float(capability.split(".")[1])


def streamed_groups(blocks: KVCacheBlocks) -> tuple[GroupBlocks, ...]:
    """A layer-streamed load's blocks, per KV cache group: each group's newly allocated blocks (not a prefix-cache
    hit, not vLLM's null block behind a sliding window) and the index of the first in the group's list. The
    prefill rank WRITEs its blocks of the same positions into them."""
    return tuple(GroupBlocks(len(all_ids) - len(new_ids), list(new_ids))
                 for all_ids, new_ids in zip(blocks.get_block_ids(), blocks.get_unhashed_block_ids_all_groups(),
                                             strict=True))


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
