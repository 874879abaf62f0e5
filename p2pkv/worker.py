"""Worker-side orchestration: register KV memory, serve metadata, pull, notify, release.

Decode side: each :class:`~p2pkv.metadata.RecvTask` waits for the peer's
handshake (run on a background thread, once per prefill rank), then becomes
one NIXL READ of coalesced descriptors with a completion notification, polled
in :meth:`WorkerSide.get_finished`. Failures mark the local blocks in
:meth:`WorkerSide.get_block_ids_with_load_errors` and still report the
request as finished receiving, so vLLM recomputes or fails it per
``kv_load_failure_policy``.

Prefill side: blocks of finished requests are held until the decode side's
notification arrives or the lease expires, whichever first.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from handshake import (
    AgentInfo,
    HandshakeServer,
    KVLayoutDesc,
    compute_digest,
    fetch_agent_info,
    send_heartbeat,
)
from p2pkv.config import P2pKvConfig
from p2pkv.holds import PrefillHolds
from p2pkv.layout import KVLayout, describe_torch_kv_caches, detect_attn_layout
from p2pkv.metadata import P2pKvMetadata, RecvTask
from p2pkv.negotiate import (
    PullRefused,
    layout_desc,
    page_slices,
    plan_peer,
    remote_segments,
    total_heads,
)
from p2pkv.plan import PlanError, build_descriptors, coalesce_runs
from p2pkv.pulls import Group, Peer, Pending, Pull, failure_kind
from p2pkv.receive import direct_pairs, staged_read
from p2pkv.stager import Stage, Stager
from p2pkv.staging import StagingFull
from p2pkv.stats import empty_stats, is_empty
from p2pkv.topology import RankRead, TopologyError, notifiers_of, notify_ranks, read_plan
from p2pkv.transfer import NixlTransferAgent, TransferError, unique_agent_name

logger = logging.getLogger("p2pkv.worker")

NOTIF_DONE = b"p2pkv:done:"


class WorkerSide:
    """The connector's worker-side half for one tp_rank.

    Args:
        engine_id: this engine's id.
        config: p2pkv settings.
        tp_rank: this worker's tensor-parallel rank.
        tp_size: this engine's tensor-parallel size.
        side_channel_host: address the side-channel server binds to.
        side_channel_port: this rank's side-channel port.
        compat_hash: what peers must match (see :func:`p2pkv.connector.compat_hash`).
        model_info: ``dtype``, ``num_kv_heads``, ``head_dim``, ``block_size``,
            ``kv_layout``, ``attn_layout`` of this engine.
    """

    def __init__(self, engine_id: str, config: P2pKvConfig, tp_rank: int, tp_size: int,
                 side_channel_host: str, side_channel_port: int, compat_hash: str,
                 model_info: dict[str, Any]) -> None:
        self.engine_id = engine_id
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.host = side_channel_host
        self.port = side_channel_port
        self.compat_hash = compat_hash
        self.model_info = model_info
        self.agent: NixlTransferAgent | None = None
        self.server: HandshakeServer | None = None
        self.layout: KVLayout | None = None
        self.desc: KVLayoutDesc | None = None
        self._secret = config.secret.encode() if config.secret else None
        self._stop = threading.Event()
        self._handshake_threads: list[threading.Thread] = []
        self._confirming: dict[tuple[str, int], list[Pull]] = {}
        self._confirms: dict[int, tuple[Future, list[Pull]]] = {}
        self._confirm_seq = 0
        self._peers: dict[tuple[str, int], Peer] = {}
        self._pending: dict[tuple[str, int], Pending] = {}
        self._pulls: list[Pull] = []
        self._holds = PrefillHolds(config.lease_s)
        self._leases = self._holds.leases
        self._early_notifs = self._holds.notifs
        self._stager: Stager | None = None
        self._device_id = 0
        self._staging_wait: list[RecvTask] = []
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._retried: set[str] = set()
        self._stats = empty_stats()
        self._closed = False

    # ---- setup -----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """Register this worker's KV tensors with NIXL and start serving metadata.

        Args:
            kv_caches: layer name → KV tensor (any of vLLM's layouts).
            num_blocks: blocks per layer.
        """
        first = next(iter(kv_caches.values()))
        mem_type = "VRAM" if first.is_cuda else "DRAM"
        device_id = (first.device.index or 0) if first.is_cuda else 0
        self.layout = describe_torch_kv_caches(kv_caches, num_blocks)
        self.agent = NixlTransferAgent(
            unique_agent_name(self.engine_id, self.tp_rank),
            self.config.nixl_backends,
            self.config.nixl_progress_thread,
            self.config.nixl_num_threads,
            self.config.backend_params(),
        )
        self.agent.register(self.layout.regions, mem_type, device_id)
        info = dict(self.model_info)
        detected = detect_attn_layout(first, int(info["num_kv_heads"]), int(info["block_size"]))
        if detected is not None and info.get("attn_layout") != "CPU":
            info["attn_layout"] = detected
        self.desc = layout_desc(self.layout, mem_type=mem_type, device_id=device_id, **info)
        self._device_id = device_id
        self._stager = Stager(self.agent, kv_caches, self.layout, self.desc, int(self.config.staging_mib * 2**20))
        meta = self.agent.metadata()
        info = AgentInfo(
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            agent_name=self.agent.name,
            agent_metadata=meta,
            metadata_digest=compute_digest(meta),
            compat_hash=self.compat_hash,
            layout=self.desc,
        )
        self.server = HandshakeServer(self.host, self.port, self.compat_hash, secret=self._secret,
                                      on_heartbeat=self._on_heartbeat)
        self.server.set_info(info)
        self.server.start()
        logger.info(
            "p2pkv: rank %d registered %d %s region(s), %d segment(s) per block (%s), "
            "%d B per block; side channel on %s:%d",
            self.tp_rank, len(self.layout.regions), mem_type, len(self.layout.segments),
            "cross-layer" if self.layout.cross_layer else "per-layer",
            self.layout.block_bytes, self.host, self.server.port,
        )

    # ---- decode side ------------------------------------------------------
    def start_load_kv(self, meta: P2pKvMetadata) -> None:
        """Take this step's new pulls and leases."""
        for request_id, deadline in meta.send_leases.items():
            self._leases.hold(request_id, deadline)
        waiting, self._staging_wait = self._staging_wait, []
        for task in [*waiting, *meta.recv]:
            self._queue(task)

    def _topology(self, task: RecvTask) -> tuple[list[RankRead], list[int]]:
        """The prefill ranks this rank reads (with head slices) and notifies for ``task``.

        Raises:
            PullRefused: the heads cannot be mapped between the two TP sizes.
        """
        assert self.desc is not None
        heads = total_heads(self.desc, self.tp_size)
        try:
            args = (self.tp_rank, self.tp_size, task.remote.tp_size, heads, self.desc.is_mla)
            return read_plan(*args), notify_ranks(*args)
        except TopologyError as exc:
            raise PullRefused(f"prefill tp_size={task.remote.tp_size}, decode tp_size={self.tp_size}: {exc}") from exc

    def _queue(self, task: RecvTask) -> None:
        try:
            reads, notify = self._topology(task)
        except PullRefused as exc:
            self._fail(task, f"refused: {exc}", "refused")
            return
        engine = task.remote.engine_id
        keys = sorted({(engine, r.remote_rank) for r in reads} | {(engine, r) for r in notify})
        missing = [k for k in keys if k not in self._peers]
        if not missing:
            self._start_group(task, reads, notify)
            return
        for key in missing:
            pending = self._pending.setdefault(key, Pending())
            if pending.future is None:
                pending.future = self._start_handshake(task.remote.host, task.remote.port + key[1], key[1])
        self._pending[missing[0]].tasks.append(task)  # re-queued when it is done; waits for the rest then

    def _start_handshake(self, host: str, port: int, tp_rank: int) -> Future:
        """Fetch a peer's AgentInfo on its own daemon thread (one per peer, so an
        unreachable prefill engine does not delay handshakes with the others);
        :meth:`shutdown` cancels it within 0.1 s."""
        return self._in_thread(
            f"p2pkv-handshake-{host}:{port}", fetch_agent_info, host, port, tp_rank, self.engine_id,
            self.compat_hash, secret=self._secret, timeout_s=self.config.handshake_timeout_s,
            retries=self.config.handshake_retries, cancel=self._stop)

    def _in_thread(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Future:
        """Run a side-channel call on a daemon thread; its result arrives in the Future.
        Every such call takes ``cancel=self._stop``, so :meth:`shutdown` ends it quickly."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # delivered to the step that polls the future
                future.set_exception(exc)

        self._handshake_threads = [t for t in self._handshake_threads if t.is_alive()]
        thread = threading.Thread(target=run, name=name, daemon=True)
        self._handshake_threads.append(thread)
        thread.start()
        return future

    def _progress_handshakes(self) -> None:
        for key, pending in list(self._pending.items()):
            if pending.future is None or not pending.future.done():
                continue
            del self._pending[key]
            try:
                info: AgentInfo = pending.future.result()
                assert self.agent is not None and self.desc is not None
                plan = plan_peer(self.desc, self.tp_rank, self.tp_size, info.layout, key[1], info.tp_size)
                name = self.agent.add_peer(info)
                peer = self._peers[key] = Peer(info, name, remote_segments(info.layout), plan)
                if plan.paged:
                    r = plan.read
                    peer.local_slices = page_slices(self.desc, list(self.layout.segments), r.local_head_start,
                                                    r.num_heads)
                    peer.remote_slices = page_slices(info.layout, peer.segments, r.remote_head_start, r.num_heads)
                self._stats["handshake_seconds"].append(time.monotonic() - pending.started)
                logger.info("p2pkv: handshake with %s rank %d done (agent %s, %s)", key[0], key[1], name,
                            "direct" if plan.direct else
                            f"{'per-page head slices' if plan.paged else 'staged + fixup'}: {plan.reason}")
            except Exception as exc:
                for task in pending.tasks:
                    self._fail(task, f"handshake with {task.remote.host}:{task.remote.port + key[1]} failed: {exc}",
                               "refused" if isinstance(exc, PullRefused) else "handshake")
                continue
            for task in pending.tasks:
                self._queue(task)  # not _start_group: a failed start drops the peer for the rest

    def _start_group(self, task: RecvTask, reads: list[RankRead], notify: list[int]) -> None:
        engine = task.remote.engine_id
        args = (self.tp_size, task.remote.tp_size, total_heads(self.desc, self.tp_size), self.desc.is_mla)
        group = Group(task, time.monotonic(), [((engine, r), notifiers_of(r, *args)) for r in notify])
        parts: list[tuple[tuple[str, int], Peer, np.ndarray, np.ndarray, Stage | None]] = []
        try:
            for read in reads:
                key = (engine, read.remote_rank)
                part = self._plan_part(task, key, self._peers[key], read)
                if part is None:  # no room in staging yet: wait for pulls in flight to finish
                    self._release_parts(parts)
                    parts = []
                    if self._stager.idle:  # nothing else holds staging: this pull can never fit
                        raise StagingFull(f"a pull from {len(reads)} prefill ranks needs more staging than "
                                          "staging_mib holds; raise staging_mib in kv_connector_extra_config")
                    self._staging_wait.append(task)
                    return
                if part[1].size:
                    parts.append((key, self._peers[key], *part))
        except (PlanError, StagingFull) as exc:
            self._release_parts(parts)
            self._fail(task, f"bad block ids: {exc}" if isinstance(exc, PlanError) else str(exc),
                       "bad_block_ids" if isinstance(exc, PlanError) else "staging")
            return
        if not parts:  # nothing to load (or a notify-only task)
            self._notify_group(group)
            if task.report:
                self._finished_recving.add(task.request_id)
            return
        group.parts = len(parts)
        for i, (key, peer, local_descs, remote_descs, stage) in enumerate(parts):
            try:
                handle = self.agent.start_read(peer.agent_name, local_descs, remote_descs, b"")
            except Exception as exc:
                self._release_parts(parts[i:])
                self._abandon(group)
                self._drop_peer(key)
                self._retry_or_fail(task, f"pull from {peer.agent_name} could not start: {exc}", failure_kind(exc))
                return
            self._pulls.append(Pull(task, handle, time.monotonic(), key, peer, group, stage))

    def _plan_part(self, task: RecvTask, key: tuple[str, int], peer: Peer,
                   read: RankRead) -> tuple[np.ndarray, np.ndarray, Stage | None] | None:
        """Descriptors for one prefill rank's share of a pull (None: staging is full for now).

        Raises:
            PlanError: bad block ids.
            StagingFull: the pull can never fit in staging.
        """
        assert self.layout is not None and self._stager is not None and self.desc is not None
        remote = peer.info.layout
        if peer.plan.direct or peer.plan.paged:
            local_ids, remote_ids = direct_pairs(task, self.desc.block_size)
            loc, rem, lengths = coalesce_runs(local_ids, remote_ids, self.layout.num_blocks, remote.num_blocks)
            if peer.plan.paged:
                if not all(seg.blocks_contiguous for seg in (*peer.local_slices, *peer.remote_slices)):
                    loc, rem = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
                    lengths = np.ones(loc.size, dtype=np.int64)  # one row per block on both sides
                return (build_descriptors(peer.local_slices, loc, lengths, self._device_id),
                        build_descriptors(peer.remote_slices, rem, lengths, peer.device_id), None)
            return (build_descriptors(self.layout.segments, loc, lengths, self._device_id),
                    build_descriptors(peer.segments, rem, lengths, peer.device_id), None)
        read_plan_ = staged_read(task, self.desc.block_size, remote.block_size)
        n = len(read_plan_.remote_block_ids)
        coalesce_runs(read_plan_.dst_block_ids, read_plan_.dst_block_ids, self.layout.num_blocks,
                      self.layout.num_blocks)  # validates the local ids
        stage = self._stager.reserve(read_plan_, peer.segments) if n else None
        if n and stage is None:
            return None
        if not n:
            empty = np.zeros((0, 3), dtype=np.uint64)
            return empty, empty, None
        loc, rem, lengths = coalesce_runs(np.arange(n), read_plan_.remote_block_ids, n, remote.num_blocks)
        return (build_descriptors(stage.segments, loc, lengths, self._device_id),
                build_descriptors(peer.segments, rem, lengths, peer.device_id), stage)

    def _release_parts(self, parts: list) -> None:
        for part in parts:
            if part[-1] is not None and self._stager is not None:
                self._stager.release(part[-1])

    def _abandon(self, group: Group) -> None:
        """Stop a failed group's other READs and give their staging back."""
        group.failed = True
        for pull in [p for p in self._pulls if p.group is group]:
            self.agent.cancel(pull.handle)
            if pull.stage is not None:  # the cancelled READ may still land: keep its staging out of use
                self._stager.quarantine(pull.stage, self.config.transfer_timeout_s)
        self._pulls = [p for p in self._pulls if p.group is not group]

    def _retry_or_fail(self, task: RecvTask, why: str, kind: str) -> None:
        """After a peer failure: re-handshake and try once more (the prefill engine may
        have restarted under the same engine_id); fail the pull the second time."""
        if task.request_id in self._retried:
            self._fail(task, why, kind)
            return
        logger.warning("p2pkv: %s; re-handshaking and retrying request %s once", why, task.request_id)
        self._retried.add(task.request_id)
        self._queue(task)

    def _notify_group(self, group: Group) -> None:
        """Tell every prefill rank this rank answers for that it may free the request's blocks.

        Sent after the READs are seen done and fenced, not attached to them: a READ
        with a notification completes only once the prefill side progresses NIXL,
        which would tie the decode's pull latency to the prefill engine's step time.
        The message carries how many decode ranks will notify that prefill rank. A
        notification that cannot be sent is logged; the prefill lease frees the
        blocks instead.
        """
        assert self.agent is not None
        rid = group.task.remote.request_id
        for key, notifiers in group.notify:
            peer = self._peers.get(key)
            if peer is None:
                logger.warning("p2pkv: cannot notify %s rank %d about %s (peer gone); its lease frees the blocks",
                               key[0], key[1], rid)
                continue
            msg = NOTIF_DONE + f"{rid}|{self.engine_id}:{self.tp_rank}:{notifiers}".encode()
            try:
                self.agent.send_notif(peer.agent_name, msg)
            except TransferError as exc:
                logger.warning("p2pkv: %s; the prefill engine frees the blocks when the lease ends", exc)

    def _fail(self, task: RecvTask, why: str, kind: str) -> None:
        """Report a pull as failed: its local blocks become load errors, the request finishes.

        ``kind`` is the failure type in the log line: ``handshake``,
        ``refused``, ``bad_block_ids``, ``staging``, ``fixup``, ``disconnect``,
        ``transfer``, ``timeout``, ``lease_expired`` or ``unconfirmed``.
        """
        logger.error(
            "p2pkv: pull failed kind=%s request=%s remote_request=%s peer=%s:%d blocks=%d reason=%s",
            kind, task.request_id, task.remote.request_id, task.remote.host, task.remote.port,
            len(task.local_block_ids), why,
        )
        self._load_errors.update(task.local_block_ids)
        self._retried.discard(task.request_id)
        self._stats["failures"][kind] = self._stats["failures"].get(kind, 0) + 1
        if task.report:
            self._finished_recving.add(task.request_id)

    def _drop_peer(self, key: tuple[str, int]) -> None:
        peer = self._peers.pop(key, None)
        if peer is not None and self.agent is not None:
            self.agent.remove_peer(peer.agent_name)

    def _poll_pulls(self) -> None:
        assert self.agent is not None and self._stager is not None
        now = time.monotonic()
        for pull in list(self._pulls):
            if pull not in self._pulls:
                continue  # abandoned with its group during this loop
            try:
                done = self.agent.poll(pull.handle)
            except Exception as exc:
                # Drop the peer only if it is still the one this READ used: a late failure
                # from a dead incarnation must not tear down its replacement.
                if self._peers.get(pull.peer_key) is pull.peer:
                    self._drop_peer(pull.peer_key)
                self._pulls.remove(pull)
                if pull.stage is not None:
                    self._stager.release(pull.stage)
                self._abandon(pull.group)
                self._retry_or_fail(pull.task, str(exc), failure_kind(exc))
                continue
            if done:
                self._pulls.remove(pull)
                self._retried.discard(pull.task.request_id)
                pull.done = pull.group.done = now
                pull.group.num_bytes += pull.handle.num_bytes
                pull.group.num_descriptors += pull.handle.num_descriptors
                pull.group.peers.append(pull.handle.peer)
                if pull.stage is not None:
                    try:
                        self._stager.fixup(pull.stage, pull.peer.info.layout, pull.peer.plan.read)
                    except Exception as exc:  # never let one request's fixup take the engine down
                        self._abandon(pull.group)
                        self._fail(pull.task, f"fixup after the READ failed: {exc!r}", "fixup")
                        continue
                    finally:
                        self._stager.release(pull.stage)
                self._confirming.setdefault(pull.peer_key, []).append(pull)
            elif now - pull.started > self.config.transfer_timeout_s:
                self._abandon(pull.group)  # this pull is still in self._pulls: cancelled and quarantined there
                self._fail(pull.task, f"READ still in flight after {self.config.transfer_timeout_s} s", "timeout")
        self._stager.poll_releases()

    def _progress_confirmations(self) -> None:
        """Fence finished READs: ask each prefill rank (one batch per rank and step, off the
        engine thread, batches to one rank overlapping) whether any of the pulled requests'
        leases had already expired, in which case vLLM may have reused those blocks and the
        pull must count as failed."""
        for seq, (future, pulls) in list(self._confirms.items()):
            if not future.done():
                continue
            del self._confirms[seq]
            try:
                expired = set(future.result().expired)
            except Exception as exc:
                for pull in pulls:
                    if not pull.group.failed:
                        self._abandon(pull.group)
                        self._fail(pull.task, "could not confirm that the prefill engine still held the "
                                              f"blocks: {exc}", "unconfirmed")
                continue
            for pull in pulls:
                group = pull.group
                if group.failed:
                    continue
                if pull.task.remote.request_id in expired:
                    self._abandon(group)
                    self._fail(pull.task, "the prefill lease expired before the pull finished; its blocks may "
                                          "have been reused (raise lease_s or check the lease heartbeats)",
                               "lease_expired")
                    continue
                group.confirmed += 1
                if group.confirmed < group.parts:
                    continue
                self._record(group)
                self._notify_group(group)
                if group.task.report:
                    self._finished_recving.add(group.task.request_id)
        for key, pulls in list(self._confirming.items()):
            del self._confirming[key]
            remote = pulls[0].task.remote
            ids = [p.task.remote.request_id for p in pulls]
            self._confirm_seq += 1
            self._confirms[self._confirm_seq] = (self._in_thread(
                f"p2pkv-confirm-{remote.host}:{remote.port + key[1]}", send_heartbeat,
                remote.host, remote.port + key[1], ids, self.engine_id, 10.0, secret=self._secret,
                timeout_s=self.config.handshake_timeout_s, cancel=self._stop), pulls)

    def _record(self, group: Group) -> None:
        """Count a finished pull (all its READs) in the stats and, if configured, the stats file."""
        task, seconds = group.task, group.done - group.started
        self._stats["pull_bytes"].append(group.num_bytes)
        self._stats["pull_seconds"].append(seconds)
        self._stats["pull_descriptors"].append(group.num_descriptors)
        logger.debug("p2pkv: pulled request=%s bytes=%d descriptors=%d seconds=%.6f",
                     task.request_id, group.num_bytes, group.num_descriptors, seconds)
        if self.config.stats_file:
            record = {"request_id": task.request_id, "remote_request_id": task.remote.request_id,
                      "peer": ",".join(group.peers), "blocks": len(task.local_block_ids),
                      "bytes": group.num_bytes, "descriptors": group.num_descriptors, "seconds": seconds}
            with open(self.config.stats_file, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    # ---- prefill side -----------------------------------------------------
    def _on_heartbeat(self, request_ids: list[str], extend_s: float) -> list[str]:
        """Side-channel thread: see :meth:`p2pkv.holds.PrefillHolds.on_heartbeat`."""
        return self._holds.on_heartbeat(request_ids, extend_s)

    def _released(self) -> set[str]:
        """Held requests to free now: notified by every decode reader, or lease expired."""
        assert self.agent is not None
        try:
            notifs = self.agent.get_notifs()
        except Exception as exc:  # a broken peer must not lose this step's results
            logger.warning("p2pkv: reading NIXL notifications failed: %s", exc)
            notifs = []
        return self._holds.released([m[len(NOTIF_DONE):].decode(errors="replace") for m in notifs
                                     if m.startswith(NOTIF_DONE)], self._stats)

    # ---- per step -----------------------------------------------------------
    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` request ids since the last call."""
        if self.agent is None:
            return set(), set()
        self._progress_handshakes()
        self._poll_pulls()
        self._progress_confirmations()
        recving, self._finished_recving = self._finished_recving, set()
        return self._released(), recving

    def take_stats(self) -> dict | None:
        """Pull statistics since the last call (see :mod:`p2pkv.stats`), or None if none."""
        if is_empty(self._stats):
            return None
        stats, self._stats = self._stats, empty_stats()
        return stats

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose pull failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Close the side channel, drop peers, deregister memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for thread in self._handshake_threads:
            thread.join(timeout=2.0)
        self._handshake_threads.clear()
        if self.server is not None:
            self.server.close()
        if self.agent is not None:
            for pull in self._pulls:
                self.agent.cancel(pull.handle)
            self._pulls.clear()
            self.agent.close()
