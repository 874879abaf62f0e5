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
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from handshake import (
    AgentInfo,
    HandshakeServer,
    KVLayoutDesc,
    KVRegion,
    compute_digest,
    fetch_agent_info,
    send_heartbeat,
)
from p2pkv.config import P2pKvConfig
from p2pkv.layout import KVLayout, Segment, describe_torch_kv_caches
from p2pkv.leases import LeaseTable
from p2pkv.metadata import P2pKvMetadata, RecvTask
from p2pkv.plan import PlanError, build_descriptors, coalesce_runs
from p2pkv.stats import empty_stats, is_empty
from p2pkv.transfer import NixlTransferAgent, PullHandle, TransferError, unique_agent_name

logger = logging.getLogger("p2pkv.worker")

NOTIF_DONE = b"p2pkv:done:"


@dataclass
class _Peer:
    """A prefill rank this worker pulls from."""

    info: AgentInfo
    agent_name: str
    segments: list[Segment]


@dataclass
class _Pull:
    task: RecvTask
    handle: PullHandle
    started: float
    peer_key: tuple[str, int]
    peer: _Peer
    done: float = 0.0


@dataclass
class _Pending:
    tasks: list[RecvTask] = field(default_factory=list)
    future: Future | None = None
    started: float = field(default_factory=time.monotonic)


def _failure_kind(exc: BaseException) -> str:
    """``disconnect`` when NIXL says the peer went away, else ``transfer``."""
    return "disconnect" if "DISCONNECT" in str(exc).upper() else "transfer"


class PullRefused(RuntimeError):
    """A pull cannot run against this peer (incompatible layouts, TP sizes)."""


def layout_desc(layout: KVLayout, *, kv_layout: str, attn_layout: str, dtype: str,
                num_kv_heads: int, head_dim: int, block_size: int, mem_type: str) -> KVLayoutDesc:
    """The wire form of a :class:`KVLayout` (see :class:`handshake.KVLayoutDesc`)."""
    return KVLayoutDesc(
        kv_layout=kv_layout,
        attn_layout=attn_layout,
        dtype=dtype,
        num_layers=layout.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=layout.num_blocks,
        block_len=layout.segments[0].length,
        block_stride=layout.segments[0].block_stride,
        mem_type=mem_type,
        regions=[
            KVRegion(
                base_addr=s.addr,
                length=layout.num_blocks * s.block_stride,
                layer_start=s.layer_start,
                num_layers=s.num_layers,
                kv_index=s.kv_index,
            )
            for s in layout.segments
        ],
    )


def remote_segments(desc: KVLayoutDesc) -> list[Segment]:
    """Rebuild a peer's segments from its typed layout fields (never from its bytes)."""
    return [
        Segment(r.base_addr, desc.block_len, desc.block_stride, r.layer_start, r.num_layers, r.kv_index)
        for r in desc.regions
    ]


def check_compatible(local: KVLayoutDesc, remote: KVLayoutDesc) -> None:
    """Refuse a peer whose blocks cannot be copied byte for byte into ours.

    Raises:
        PullRefused: names the field and both sides' values.
    """
    for name in ("dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "attn_layout",
                 "block_len"):
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            raise PullRefused(
                f"prefill and decode differ in {name}: prefill has {theirs!r}, decode has "
                f"{mine!r}; run both engines with the same {name}"
            )
    if len(local.regions) != len(remote.regions):
        raise PullRefused(
            f"prefill KV layout {remote.kv_layout} ({len(remote.regions)} segments per block) "
            f"differs from decode {local.kv_layout} ({len(local.regions)}); use the same "
            "kv_layout on both engines"
        )


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
        self._heartbeats: queue.SimpleQueue[tuple[list[str], float]] = queue.SimpleQueue()
        self._handshake_threads: list[threading.Thread] = []
        self._confirming: dict[tuple[str, int], list[_Pull]] = {}
        self._confirms: dict[tuple[str, int], tuple[Future, list[_Pull]]] = {}
        self._expired_lock = threading.Lock()
        self._expired_recent: dict[str, float] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._pulls: list[_Pull] = []
        self._leases = LeaseTable()
        self._early_notifs: dict[str, float] = {}
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
        self.desc = layout_desc(self.layout, mem_type=mem_type, **self.model_info)
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
        for task in meta.recv:
            self._queue(task)

    def _peer_key(self, task: RecvTask) -> tuple[str, int]:
        if task.remote.tp_size != self.tp_size:
            raise PullRefused(
                f"prefill tp_size={task.remote.tp_size} differs from decode tp_size={self.tp_size}; "
                "run both engines with the same tensor-parallel size"
            )
        return (task.remote.engine_id, self.tp_rank)

    def _queue(self, task: RecvTask) -> None:
        try:
            key = self._peer_key(task)
        except PullRefused as exc:
            self._fail(task, f"refused: {exc}", "refused")
            return
        if key in self._peers:
            self._start_pull(task, key)
            return
        pending = self._pending.setdefault(key, _Pending())
        pending.tasks.append(task)
        if pending.future is None:
            pending.future = self._start_handshake(task.remote.host, task.remote.port + key[1], key[1])

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
                check_compatible(self.desc, info.layout)
                name = self.agent.add_peer(info)
                self._peers[key] = _Peer(info, name, remote_segments(info.layout))
                self._stats["handshake_seconds"].append(time.monotonic() - pending.started)
                logger.info("p2pkv: handshake with %s rank %d done (agent %s)", key[0], key[1], name)
            except Exception as exc:
                for task in pending.tasks:
                    self._fail(task, f"handshake with {task.remote.host}:{task.remote.port + key[1]} failed: {exc}",
                               "refused" if isinstance(exc, PullRefused) else "handshake")
                continue
            for task in pending.tasks:
                self._queue(task)  # not _start_pull: a failed start drops the peer for the rest

    def _start_pull(self, task: RecvTask, key: tuple[str, int]) -> None:
        peer = self._peers[key]
        assert self.agent is not None and self.layout is not None
        notif = NOTIF_DONE + task.remote.request_id.encode()
        try:
            if not task.local_block_ids:
                self._notify(peer, notif)
                if task.report:
                    self._finished_recving.add(task.request_id)
                return
            loc, rem, lengths = coalesce_runs(
                task.local_block_ids, task.remote_block_ids,
                self.layout.num_blocks, peer.info.layout.num_blocks,
            )
            local_descs = build_descriptors(self.layout.segments, loc, lengths)
            remote_descs = build_descriptors(peer.segments, rem, lengths)
        except PlanError as exc:
            self._fail(task, f"bad block ids: {exc}", "bad_block_ids")
            return
        try:
            handle = self.agent.start_read(peer.agent_name, local_descs, remote_descs, b"")
        except Exception as exc:
            self._drop_peer(key)
            self._retry_or_fail(task, f"pull from {peer.agent_name} could not start: {exc}", _failure_kind(exc))
            return
        self._pulls.append(_Pull(task, handle, time.monotonic(), key, peer))

    def _retry_or_fail(self, task: RecvTask, why: str, kind: str) -> None:
        """After a peer failure: re-handshake and try once more (the prefill engine may
        have restarted under the same engine_id); fail the pull the second time."""
        if task.request_id in self._retried:
            self._fail(task, why, kind)
            return
        logger.warning("p2pkv: %s; re-handshaking and retrying request %s once", why, task.request_id)
        self._retried.add(task.request_id)
        self._queue(task)

    def _notify(self, peer: _Peer, msg: bytes) -> None:
        """Tell the prefill worker it may free a request's blocks.

        Sent after the READ is seen done, not attached to the READ: a READ with a
        notification completes only once the prefill side progresses NIXL, which
        would tie the decode's pull latency to the prefill engine's step time. A
        notification that cannot be sent is logged; the prefill lease frees the
        blocks instead.
        """
        assert self.agent is not None
        try:
            self.agent.send_notif(peer.agent_name, msg)
        except TransferError as exc:
            logger.warning("p2pkv: %s; the prefill engine frees the blocks when the lease ends", exc)

    def _fail(self, task: RecvTask, why: str, kind: str) -> None:
        """Report a pull as failed: its local blocks become load errors, the request finishes.

        ``kind`` is the failure type in the log line: ``handshake``,
        ``refused``, ``bad_block_ids``, ``disconnect``, ``transfer``,
        ``timeout``, ``lease_expired`` or ``unconfirmed``.
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
        assert self.agent is not None
        still: list[_Pull] = []
        now = time.monotonic()
        for pull in self._pulls:
            try:
                done = self.agent.poll(pull.handle)
            except Exception as exc:
                # Drop the peer only if it is still the one this READ used: a late failure
                # from a dead incarnation must not tear down its replacement.
                if self._peers.get(pull.peer_key) is pull.peer:
                    self._drop_peer(pull.peer_key)
                self._retry_or_fail(pull.task, str(exc), _failure_kind(exc))
                continue
            if done:
                self._retried.discard(pull.task.request_id)
                pull.done = now
                self._confirming.setdefault(pull.peer_key, []).append(pull)
            elif now - pull.started > self.config.transfer_timeout_s:
                self.agent.cancel(pull.handle)
                self._fail(pull.task, f"READ still in flight after {self.config.transfer_timeout_s} s", "timeout")
            else:
                still.append(pull)
        self._pulls = still

    def _progress_confirmations(self) -> None:
        """Fence finished READs: ask each prefill rank (one batch per rank, off the engine
        thread) whether any of the pulled requests' leases had already expired, in which
        case vLLM may have reused those blocks and the pull must count as failed."""
        for key, (future, pulls) in list(self._confirms.items()):
            if not future.done():
                continue
            del self._confirms[key]
            try:
                expired = set(future.result().expired)
            except Exception as exc:
                for pull in pulls:
                    self._fail(pull.task, f"could not confirm that the prefill engine still held the blocks: {exc}",
                               "unconfirmed")
                continue
            for pull in pulls:
                if pull.task.remote.request_id in expired:
                    self._fail(pull.task, "the prefill lease expired before the pull finished; its blocks may "
                                          "have been reused (raise lease_s or check the lease heartbeats)",
                               "lease_expired")
                    continue
                self._record(pull, pull.done)
                self._notify(pull.peer, NOTIF_DONE + pull.task.remote.request_id.encode())
                if pull.task.report:
                    self._finished_recving.add(pull.task.request_id)
        for key, pulls in list(self._confirming.items()):
            if key in self._confirms:
                continue
            del self._confirming[key]
            remote = pulls[0].task.remote
            ids = [p.task.remote.request_id for p in pulls]
            self._confirms[key] = (self._in_thread(
                f"p2pkv-confirm-{remote.host}:{remote.port + key[1]}", send_heartbeat,
                remote.host, remote.port + key[1], ids, self.engine_id, 10.0, secret=self._secret,
                timeout_s=self.config.handshake_timeout_s, cancel=self._stop), pulls)

    def _record(self, pull: _Pull, now: float) -> None:
        seconds = now - pull.started
        self._stats["pull_bytes"].append(pull.handle.num_bytes)
        self._stats["pull_seconds"].append(seconds)
        self._stats["pull_descriptors"].append(pull.handle.num_descriptors)
        logger.debug("p2pkv: pulled request=%s bytes=%d descriptors=%d seconds=%.6f",
                     pull.task.request_id, pull.handle.num_bytes, pull.handle.num_descriptors, seconds)
        if self.config.stats_file:
            record = {
                "request_id": pull.task.request_id,
                "remote_request_id": pull.task.remote.request_id,
                "peer": pull.handle.peer,
                "blocks": len(pull.task.local_block_ids),
                "bytes": pull.handle.num_bytes,
                "descriptors": pull.handle.num_descriptors,
                "seconds": seconds,
            }
            with open(self.config.stats_file, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    # ---- prefill side -----------------------------------------------------
    def _on_heartbeat(self, request_ids: list[str], extend_s: float) -> list[str]:
        """Side-channel thread: a decode engine still has these requests queued, or has
        just pulled them; returns those whose lease already expired here."""
        self._heartbeats.put((request_ids, min(extend_s, self.config.lease_s)))
        with self._expired_lock:
            return [rid for rid in request_ids if rid in self._expired_recent]

    def _apply_heartbeats(self) -> None:
        while True:
            try:
                request_ids, extend_s = self._heartbeats.get_nowait()
            except queue.Empty:
                return
            for rid in request_ids:
                self._leases.extend(rid, extend_s)

    def _released(self) -> set[str]:
        """Held requests to free now: notified by every decode reader, or lease expired."""
        assert self.agent is not None
        now = time.monotonic()
        try:
            notifs = self.agent.get_notifs()
        except Exception as exc:  # a broken peer must not lose this step's results
            logger.warning("p2pkv: reading NIXL notifications failed: %s", exc)
            notifs = []
        for msg in notifs:
            if msg.startswith(NOTIF_DONE):
                self._early_notifs[msg[len(NOTIF_DONE):].decode(errors="replace")] = now
        done = {rid for rid in list(self._early_notifs) if self._leases.release(rid)}
        for rid in done:
            del self._early_notifs[rid]
        self._apply_heartbeats()
        expired = set(self._leases.pop_expired())
        with self._expired_lock:
            for rid in expired:
                self._expired_recent[rid] = now
            horizon = now - 10 * self.config.lease_s  # remembered for late pulls' confirmations
            for rid in [r for r, t in self._expired_recent.items() if t < horizon]:
                del self._expired_recent[rid]
        for rid in expired:
            logger.warning("p2pkv: lease of request %s expired before a decode engine pulled it; "
                           "releasing its blocks", rid)
        # A notification for a request not (yet) leased here is kept one lease long.
        for rid, t in list(self._early_notifs.items()):
            if now - t > self.config.lease_s:
                del self._early_notifs[rid]
        self._stats["leases_expired"] += len(expired)
        self._stats["leases_notified"] += len(done)
        return done | expired

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
