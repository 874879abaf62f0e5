"""The NIXL agent of one worker: register KV memory, add peers, READ and WRITE, poll, notify.

A thin typed layer over ``nixl._api.nixl_agent``. Pulls are built from
coalesced descriptor arrays (:mod:`p2pkv.dataplane.plan`) with ``initialize_xfer``, so
one run of consecutive blocks is one descriptor per segment. Remote agent
metadata is checked against its digest before it reaches NIXL (NIXL can crash
on corrupted metadata).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from handshake import AgentInfo, verify_agent_info
from p2pkv.dataplane.inboxes import ALIVE_PREFIX, Inboxes
from p2pkv.dataplane.layout import Region
from p2pkv.dataplane.plan import split_rows
from p2pkv.dataplane.remote_agents import PeerRole, RemoteAgents, WrongAgentName
from p2pkv.dataplane.transport import TransportReport, TransportWatch

logger = logging.getLogger("p2pkv.dataplane.agent")


class TransferError(RuntimeError):
    """A NIXL call failed; the message names the peer and the operation.

    Attributes:
        disconnected: NIXL said the peer went away (its error names a remote
            disconnect), as opposed to any other failure.
    """

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.disconnected = cause is not None and "DISCONNECT" in f"{type(cause).__name__} {cause}".upper()


Op = Literal["READ", "WRITE"]
"""A NIXL xfer's direction: ``READ`` (pull: remote memory into local) or ``WRITE`` (push: local into remote)."""


@dataclass
class XferHandle:
    """One NIXL xfer (a READ or a WRITE) in flight.

    Attributes:
        peer: remote agent name.
        handle: the NIXL transfer handle.
        num_bytes: bytes this xfer moves.
        num_descriptors: descriptors on each side, as planned (before any ``split_bytes`` cut).
        op: ``"READ"`` or ``"WRITE"``.
    """

    peer: str
    handle: object
    num_bytes: int
    num_descriptors: int
    op: Op = "READ"


def load_nixl() -> tuple[type, type]:
    """``(nixl_agent, nixl_agent_config)`` from whichever NIXL build is installed.

    Tries the ``nixl`` meta package first (it picks the CUDA major), then the
    ``nixl_cu13`` / ``nixl_cu12`` wheels directly.

    Raises:
        TransferError: no NIXL build is installed; names the packages to install.
    """
    import importlib

    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(mod)
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise TransferError(
        "NIXL is not installed: pip install 'p2pkv[nixl-cu13]' (CPU machines and CUDA 13) "
        "or 'p2pkv[nixl-cu12]' (CUDA 12)"
    )


def _strict_sync() -> object | None:
    """NIXL's thread-safe agent mode (``NIXL_THREAD_SYNC_STRICT``), or None where this NIXL has none."""
    import importlib

    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(mod).nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        except (ImportError, AttributeError):
            continue
    return None


def unique_agent_name(engine_id: str, rank: int) -> str:
    """A NIXL agent name unique per process incarnation, for worker ``rank`` of ``engine_id`` (its rank in its
    engine, ``pp_rank * tp_size + tp_rank``: :attr:`handshake.AgentInfo.rank`).

    NIXL keeps a remote name poisoned after bad metadata, and a restarted
    engine must not be confused with its previous life, so every agent gets
    a fresh suffix (12 hex digits).
    """
    return f"p2pkv-{engine_id}-tp{rank}-{uuid.uuid4().hex[:12]}"


def is_agent_name_of(name: str, engine_id: str, rank: int) -> bool:
    """True when ``name`` is one :func:`unique_agent_name` gives worker ``rank`` of ``engine_id``.

    No other (engine id, rank) pair has such a name (the rank's digits run
    from the last ``-tp`` to the 12-digit suffix), so a check of this binds an
    agent name to one identity.
    """
    prefix = f"p2pkv-{engine_id}-tp{rank}-"
    suffix = name[len(prefix):]
    return (rank >= 0 and name.startswith(prefix) and len(suffix) == 12
            and all(c in "0123456789abcdef" for c in suffix))


_SERDES_AGENT = b"nixlSerDes|Agent"


def metadata_agent_name(metadata: bytes) -> str | None:
    """The agent name NIXL reads from serialized agent metadata, without loading it.

    NIXL's metadata (``nixlSerDes``) opens with the tag ``Agent``, an 8-byte
    little-endian length and the name; NIXL loads (or replaces) the remote
    agent of that name, whatever the side channel said. Checked before
    :meth:`NixlTransferAgent.add_peer` hands metadata to NIXL.

    Returns:
        The name, or None when the metadata does not open that way (or the
        name is not UTF-8).
    """
    head = len(_SERDES_AGENT)
    if not metadata.startswith(_SERDES_AGENT) or len(metadata) < head + 8:
        return None
    length = int.from_bytes(metadata[head:head + 8], "little")
    end = head + 8 + length
    if length > 4096 or len(metadata) <= end or metadata[end:end + 1] != b"|":
        return None
    try:
        return metadata[head + 8:end].decode()
    except UnicodeDecodeError:
        return None


def check_peer_info(info: AgentInfo) -> None:
    """Check a peer's :class:`AgentInfo` before NIXL sees its metadata: the digest, and that the metadata
    names the agent the side channel named (else NIXL would load it under another name, replacing that
    agent's metadata).

    Raises:
        handshake.MetadataDigestError: the metadata does not match its digest.
        TransferError: the metadata names another agent, or cannot be read.
    """
    verify_agent_info(info)
    inside = metadata_agent_name(info.agent_metadata)
    if inside != info.agent_name:
        raise TransferError(f"peer metadata names agent {inside!r} but the side channel said {info.agent_name!r}"
                            if inside is not None else
                            f"peer metadata for {info.agent_name!r} does not start with the agent name "
                            "(not NIXL metadata, or a NIXL version whose format p2pkv does not read)")


def _create_backends(agent: Any, backends: Sequence[str], num_threads: int, split_bytes: int,
                     backend_params: dict[str, dict[str, str]], engine_config: str) -> None:
    """Create ``backends`` on NIXL ``agent`` (those its plugins offer), each with ``num_threads`` worker threads
    (0: NIXL's default), ``split_batch_size`` 1 when READs are split (``split_bytes``), the caller's
    ``backend_params``, and for UCX the transport watch's ``engine_config`` entries before the caller's.

    Raises:
        TransferError: a backend refused its parameters, or one of ``backends`` is not available.
    """
    for backend in backends:
        if backend not in agent.plugin_list:
            continue
        params = {"num_threads": str(num_threads)} if num_threads > 0 else {}
        if num_threads > 0 and split_bytes > 0:
            params["split_batch_size"] = "1"
        params.update(backend_params.get(backend, {}))
        if backend == "UCX" and engine_config:  # the caller's engine_config entries win
            params["engine_config"] = ",".join(c for c in (engine_config, params.get("engine_config", "")) if c)
        try:
            agent.create_backend(backend, params)
        except Exception as exc:
            raise TransferError(f"NIXL backend {backend} rejected parameters {params}: {exc}", exc) from exc
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise TransferError(
            f"NIXL backend(s) {missing} unavailable (plugins: {agent.plugin_list}); "
            "check the nixl install and P2PKV_NIXL_BACKENDS"
        )


class NixlTransferAgent:
    """One NIXL agent with registered KV memory.

    Its peer table (:meth:`add_peer`, :meth:`remove_peer`, :meth:`peers`) is
    a :class:`p2pkv.dataplane.remote_agents.RemoteAgents`, with a lock of its
    own: on a ``role: both`` engine several threads load and drop remote
    agents at once, possibly the same one under its two roles.

    Args:
        name: agent name (see :func:`unique_agent_name`).
        backends: NIXL backends to create, e.g. ``["UCX"]``.
        progress_thread: run NIXL's progress thread.
        num_threads: backend worker threads (0: NIXL default).
        backend_params: extra init parameters per backend, e.g.
            ``{"UCX": {"ucx_error_handling_mode": "none", "num_workers": "2"}}``.
        report_transport: learn and log which UCX transport moves each
            peer's READs (:mod:`p2pkv.dataplane.transport`); each report is
            also handed to :attr:`on_transport`.
        split_bytes: with ``num_threads`` > 0, cut READ descriptors longer
            than this many bytes into pieces
            (:func:`p2pkv.dataplane.plan.split_rows`) so that NIXL's UCX
            thread pool, which splits a READ by descriptor count
            (``split_batch_size``, then 1 unless given), moves one READ on
            all its threads; 0, or no thread pool: never.

    Raises:
        TransferError: NIXL is not installed or the agent cannot be created.
    """

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = False,
        num_threads: int = 0,
        backend_params: dict[str, dict[str, str]] | None = None,
        report_transport: bool = True,
        split_bytes: int = 0,
    ) -> None:
        nixl_agent, nixl_agent_config = load_nixl()
        conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        conf.sync_mode = _strict_sync()  # a decode worker posts from its engine thread and polls from another
        self.name = name
        self._agent = nixl_agent(name, conf)
        self._watch = TransportWatch(name) if report_transport and "UCX" in backends else None
        self.on_transport: Callable[[TransportReport], None] | None = None
        """Called with each peer's :class:`TransportReport` after its first READ (from the polling thread)."""
        self.on_peer_removed: Callable[[str], None] | None = None
        """Called with a remote agent's name once it left NIXL (from the thread that removed it)."""
        engine_config = self._watch.engine_config() if self._watch is not None else ""
        _create_backends(self._agent, backends, num_threads, split_bytes, backend_params or {}, engine_config)
        self._split_bytes = split_bytes if num_threads > 0 else 0
        self._reg_descs: list[object] = []
        self._mem_type = "DRAM"
        self._remote = RemoteAgents(lambda meta: self._agent.add_remote_agent(meta),
                                    lambda name: self._agent.remove_remote_agent(name))
        self.registrations = 0
        """How many times memory was registered (a peer that writes here needs metadata newer than that)."""
        self._closed = False
        self._inboxes = Inboxes(lambda: self._agent.get_new_notifs())

    @property
    def mem_type(self) -> str:
        """NIXL memory type of the registered regions (``DRAM`` or ``VRAM``)."""
        return self._mem_type

    def register(self, regions: Sequence[Region], mem_type: str, device_id: int = 0) -> None:
        """Register KV memory regions with NIXL.

        Args:
            regions: allocations to register (bytes).
            mem_type: ``"DRAM"`` (host memory) or ``"VRAM"`` (GPU memory).
            device_id: GPU index for VRAM, 0 for DRAM.

        Raises:
            TransferError: registration failed.
        """
        rows = [(r.addr, r.length, device_id, "") for r in regions]
        try:
            descs = self._agent.register_memory(rows, mem_type)
        except Exception as exc:
            raise TransferError(f"NIXL register_memory of {len(rows)} {mem_type} regions failed: {exc}", exc) from exc
        self._reg_descs.append(descs)
        self._mem_type = mem_type
        self.registrations += 1

    def metadata(self) -> bytes:
        """This agent's NIXL metadata, to publish on the side channel.

        Raises:
            TransferError: NIXL could not produce it.
        """
        try:
            return self._agent.get_agent_metadata()
        except Exception as exc:
            raise TransferError(f"NIXL get_agent_metadata of {self.name} failed: {exc}", exc) from exc

    def add_peer(self, info: AgentInfo, role: PeerRole = "prefill") -> str:
        """Verify a peer's metadata (:func:`check_peer_info`), then load it into NIXL (again, when the peer's
        metadata changed: NIXL then also knows memory it registered since, such as a decode rank's staging
        area). Loading again while an xfer to that peer is in flight is the caller's to avoid.

        Args:
            info: the peer's :class:`AgentInfo`.
            role: why it is loaded (:data:`PeerRole`); :meth:`remove_peer` with the same role undoes it.

        Returns:
            The remote agent name to pull from.

        Raises:
            handshake.MetadataDigestError: the metadata does not match its digest.
            TransferError: the metadata names another agent, or NIXL refused it.
        """
        check_peer_info(info)
        try:
            return self._remote.add(info, role)
        except WrongAgentName as exc:
            raise TransferError(str(exc)) from exc
        except Exception as exc:
            raise TransferError(f"NIXL add_remote_agent for {info.agent_name} failed: {exc}", exc) from exc

    def remove_peer(self, name: str, role: PeerRole = "prefill") -> None:
        """Forget a peer for ``role`` (after it disconnected, restarted or went idle); NIXL removes its remote
        agent once no role needs it. Removing it while an xfer to it is in flight is the caller's to avoid.
        Idempotent. Once it is removed, what UCX reported of it is forgotten and :attr:`on_peer_removed` is
        called with its name."""
        if not self._remote.remove(name, role):
            return
        if self._watch is not None:
            self._watch.forget(name)
        if self.on_peer_removed is not None:
            self.on_peer_removed(name)

    def peers(self, role: PeerRole | None = None) -> list[str]:
        """The remote agents loaded in NIXL now (for ``role`` only, when given)."""
        return self._remote.names(role)

    def start_read(self, peer: str, local_descs: np.ndarray, remote_descs: np.ndarray,
                   notif: bytes = b"") -> XferHandle:
        """Post a READ of ``remote_descs`` (peer memory) into ``local_descs`` (see :meth:`start_xfer`)."""
        return self.start_xfer("READ", peer, local_descs, remote_descs, notif)

    def start_write(self, peer: str, local_descs: np.ndarray, remote_descs: np.ndarray, notif: bytes) -> XferHandle:
        """Post a WRITE of ``local_descs`` into ``remote_descs`` (peer memory); ``notif`` reaches the peer
        after the bytes (see :meth:`start_xfer`)."""
        return self.start_xfer("WRITE", peer, local_descs, remote_descs, notif)

    def start_xfer(self, op: Op, peer: str, local_descs: np.ndarray, remote_descs: np.ndarray,
                   notif: bytes) -> XferHandle:
        """Post one xfer between ``local_descs`` and ``remote_descs`` (peer memory).

        Args:
            op: ``"READ"`` (remote into local) or ``"WRITE"`` (local into remote).
            peer: remote agent name from :meth:`add_peer`.
            local_descs: uint64 [n, 3] ``(addr, len, device_id)`` rows.
            remote_descs: uint64 [n, 3] rows, same lengths row by row.
            notif: message delivered to the peer when the xfer completes (``b""``: none).

        Raises:
            TransferError: the descriptor lists do not pair up, or NIXL
                refused or failed to post the transfer.
        """
        if local_descs.shape != remote_descs.shape or not np.array_equal(
            local_descs[:, 1], remote_descs[:, 1]
        ):
            raise TransferError("local and remote descriptor lists do not pair up row by row")
        planned = int(local_descs.shape[0])
        if self._split_bytes > 0:
            local_descs, remote_descs = split_rows(local_descs, remote_descs, self._split_bytes)
        if self._watch is not None:
            self._watch.before_xfer(peer, op)
        handle = None
        direction = "from" if op == "READ" else "to"
        try:
            local = self._agent.get_xfer_descs(local_descs, self._mem_type)
            remote = self._agent.get_xfer_descs(remote_descs, self._mem_type)
            handle = self._agent.initialize_xfer(op, local, remote, peer, notif)
            state = self._agent.transfer(handle)
        except Exception as exc:
            if handle is not None:  # a post that raised (peer gone) still holds NIXL's and UCX's request
                self._release(handle)
            raise TransferError(f"NIXL {op} {direction} {peer} could not start: {exc}", exc) from exc
        if state == "ERR":
            self._release(handle)
            raise TransferError(f"NIXL {op} {direction} {peer} failed to post")
        return XferHandle(peer, handle, int(local_descs[:, 1].sum()), planned, op)

    def poll(self, xfer: XferHandle) -> bool:
        """True when the xfer is done (its handle is then released).

        Raises:
            TransferError: the xfer failed or the peer disconnected (the
                handle is released).
        """
        direction = "from" if xfer.op == "READ" else "to"
        try:
            state = self._agent.check_xfer_state(xfer.handle)
        except Exception as exc:
            self._release(xfer.handle)
            raise TransferError(f"NIXL {xfer.op} {direction} {xfer.peer} failed: {exc}", exc) from exc
        if state == "DONE":
            self._release(xfer.handle)
            if self._watch is not None:
                report = self._watch.after_xfer(xfer.peer, self._mem_type, xfer.op)
                if report is not None and self.on_transport is not None:
                    self.on_transport(report)
            return True
        if state == "ERR":
            self._release(xfer.handle)
            raise TransferError(f"NIXL {xfer.op} {direction} {xfer.peer} ended in error")
        return False

    def cancel(self, xfer: XferHandle) -> bool:
        """Give up on an xfer (timeout, a failed sibling); best effort.

        Returns:
            True when NIXL released the transfer; False when it refused
            because the xfer is still active (its bytes may still land: poll
            it until it ends before reusing the memory it writes).
        """
        return self._release(xfer.handle)

    def _release(self, handle: object) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.debug("p2pkv: release_xfer_handle failed: %s", exc)
            return False
        return True

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a notification to a peer.

        Raises:
            TransferError: NIXL could not send it.
        """
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:
            raise TransferError(f"NIXL send_notif to {peer} failed: {exc}", exc) from exc

    def reachable(self, peer: str) -> bool:
        """Whether the transport still reaches ``peer`` (a loaded remote agent): False only when NIXL says it
        disconnected (its process is gone: a notification to it fails at once with a remote disconnect), which
        proves that none of its WRITEs can land here any more; True otherwise (any other error proves nothing).
        Sends one tiny notification, which the peer drops (:data:`p2pkv.dataplane.inboxes.ALIVE_PREFIX`)."""
        try:
            self.send_notif(peer, ALIVE_PREFIX)
        except TransferError as exc:
            return not exc.disconnected
        return True

    def progress(self) -> None:
        """Progress NIXL's workers without taking anything: a notification sent to a peer just loaded may wait
        for this side's worker to finish connecting (UCX wire-up), and notifications received meanwhile stay
        in their inboxes for :meth:`take_notifs`. Thread-safe."""
        self._inboxes.progress()

    def get_notifs(self) -> list[bytes]:
        """Notifications received since the last call (all peers) not taken by :meth:`take_notifs`'s prefixes."""
        return self._inboxes.take(b"")

    def take_notifs(self, prefix: bytes) -> list[bytes]:
        """Notifications starting with ``prefix`` received since the last call (``b""``: every other one);
        sorted by prefix for the readers sharing this agent (:class:`p2pkv.dataplane.inboxes.Inboxes`).
        Thread-safe."""
        return self._inboxes.take(prefix)

    def close(self) -> None:
        """Remove peers, deregister memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._remote.clear()
        for descs in self._reg_descs:
            try:
                self._agent.deregister_memory(descs)
            except Exception as exc:
                logger.warning("p2pkv: deregister_memory failed: %s", exc)
        self._reg_descs.clear()
        if self._watch is not None:
            self._watch.close()

    def set_auto_push(self, on: bool) -> None:
        """This agent's owner pushes where its READs are not zero-copy (``transfer_mode: auto``): a slow READ
        of GPU memory is then reported at INFO, not as a warning
        (:func:`p2pkv.dataplane.transport.warn_vram_over_tcp`)."""
        if self._watch is not None:
            self._watch.auto_push = on

    @property
    def transports(self) -> dict[str, TransportReport]:
        """Peer name → which UCX transport moved its READs (peers with a finished READ; empty when not reported)."""
        return dict(self._watch.reports) if self._watch is not None else {}
