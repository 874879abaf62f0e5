"""Which prefill ranks a decode worker keeps: handshakes started for pulls, at most :data:`MAX_PEERS`, idle ones
dropped.

Each request names its prefill engine (host, port, ``tp_size``), so without
a bound every new name would leave a NIXL remote agent, a fence connection
and its lane behind for good. :class:`PeerKeeper` starts the handshakes a
pull needs only when they fit in :data:`MAX_PEERS` (peers known plus handshakes
in flight), dropping the least recently used peers no pull needs to make
room, and drops peers unused for :data:`PEER_IDLE_S`. A dropped peer takes its
NIXL remote agent and its fence connection with it (the connection's lane
then holds nothing); the next pull from it handshakes again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

from handshake import IncompatiblePeerError
from p2pkv.config import P2pKvConfig
from p2pkv.dataplane.negotiate import PairRefused
from p2pkv.decode.background import Background
from p2pkv.decode.failures import FailureKind
from p2pkv.decode.fence import Fence
from p2pkv.decode.peers import HANDSHAKE_ATTEMPTS, Peer, PeerId, PeerTable
from p2pkv.decode.transfer import Transfer, TransferState

logger = logging.getLogger("p2pkv.decode")

MAX_PEERS = 256
"""Most prefill ranks a decode worker keeps (handshaken, or being handshaken) at once. When a pull needs more,
the least recently used ones no pull needs are dropped (their NIXL remote agent and fence connection); when none
can be, the pull is refused (``kind=refused``). It bounds what a stream of new prefill names leaves behind, far
above the prefill ranks one decode worker pulls from in a deployment (one per prefill engine and TP rank)."""

PEER_IDLE_S = 600.0
"""A prefill rank no pull has used for this long (seconds) is dropped; the next pull from it handshakes again
(one handshake, milliseconds, per ten idle minutes)."""

IDLE_CHECK_S = 1.0
"""Longest pause (seconds) between two looks for idle peers."""


class PeerKeeper:
    """Starts handshakes within :data:`MAX_PEERS` and drops the peers no pull needs.

    Args:
        peers: the worker's peer table.
        fence: the worker's fence (a dropped peer's connection is closed).
        background: where handshakes run.
        engine_id / compat_hash / secret: what a handshake sends and checks.
        config: ``handshake_timeout_s``.

    Attributes:
        attempts: attempts each handshake makes (:data:`p2pkv.decode.peers.HANDSHAKE_ATTEMPTS`; fault tests
            make it 1 to fail fast).
    """

    def __init__(self, peers: PeerTable, fence: Fence, background: Background, *, engine_id: str,
                 compat_hash: str, secret: bytes | None, config: P2pKvConfig) -> None:
        self.peers, self.fence, self.background, self.config = peers, fence, background, config
        self.engine_id, self.compat_hash, self.secret = engine_id, compat_hash, secret
        self.attempts = HANDSHAKE_ATTEMPTS
        self._idle_check_at = 0.0  # time.monotonic() of the next look for idle peers
        self._waiting: dict[PeerId, list[Transfer]] = {}  # handshake in flight → the pulls begun again after it
        self.on_peer: Callable[[Peer], None] | None = None
        """Called with each peer added, before its waiting pulls begin again (the transport probe)."""

    def handshake(self, missing: list[PeerId], busy: set[PeerId]) -> bool:
        """Start the handshakes with ``missing`` (those not in flight yet) if they fit in :data:`MAX_PEERS`,
        dropping the least recently used peers not in ``busy`` as needed.

        Returns:
            False, and nothing started or dropped, when dropping every peer not
            in ``busy`` would still not make room.
        """
        new = [pid for pid in missing if pid not in self.peers.handshakes]
        excess = len(self.peers) + len(new) - MAX_PEERS
        if excess > 0:
            victims = list(itertools.islice(self.peers.least_used(busy), excess))
            if len(victims) < excess:
                return False
            for pid in victims:
                self.forget(pid, f"MAX_PEERS={MAX_PEERS} reached; it was used least recently")
        for pid in new:
            self.peers.handshake(pid, self.background, engine_id=self.engine_id, compat_hash=self.compat_hash,
                                 secret=self.secret, timeout_s=self.config.handshake_timeout_s,
                                 attempts=self.attempts)
        return True

    def wait(self, pid: PeerId, transfer: Transfer) -> None:
        """``pull`` waits for the handshake with ``pid`` (it begins again once that ended: :meth:`ready`)."""
        self._waiting.setdefault(pid, []).append(transfer)

    def ready(self, seconds: list[float]) -> Iterator[tuple[Transfer, tuple[FailureKind, str] | None]]:
        """The unfinished pulls that waited for a handshake that has ended, each with why it fails (or None:
        begin it again); see :meth:`completed`."""
        for pid, failure in self.completed(seconds):
            for transfer in [p for p in self._waiting.pop(pid, []) if not p.finished]:
                yield transfer, failure

    def cancel_unneeded(self) -> None:
        """Cancel the handshakes not started yet that no waiting pull needs any more (after one failed)."""
        needed = {pid for transfers in self._waiting.values() for p in transfers
                  if p.state is TransferState.HANDSHAKE for pid in p.peers}
        for pid in self.peers.cancel_unneeded(needed):
            self._waiting.pop(pid, None)

    def completed(self, seconds: list[float]) -> Iterator[tuple[PeerId, tuple[FailureKind, str] | None]]:
        """Handshakes that have ended: each peer added (its handshake's duration appended to ``seconds``),
        or why its pulls fail (``refused`` when the two cannot pair, else ``handshake``)."""
        for pid, hs in self.peers.completed():
            try:
                peer = self.peers.add(pid, hs.future.result())
            except Exception as exc:
                kind = FailureKind.REFUSED if isinstance(exc, PairRefused | IncompatiblePeerError) else \
                    FailureKind.HANDSHAKE
                yield pid, (kind, f"handshake with {pid} failed: {exc}")
                continue
            seconds.append(time.monotonic() - hs.started)
            if self.on_peer is not None:
                try:
                    self.on_peer(peer)
                except Exception:  # the peer is added: its waiting pulls must begin again whatever the hook did
                    logger.exception("p2pkv: after the handshake with %s, on_peer failed", pid)
            plan = peer.plan
            logger.info("p2pkv: handshake with %s done (agent %s, %s%s)", pid, peer.agent_name, plan.placement.value,
                        f": {plan.reason}" if plan.reason else "")
            yield pid, None

    def drop_idle(self, busy: Callable[[], set[PeerId]]) -> None:
        """Drop peers not in ``busy()`` unused for :data:`PEER_IDLE_S` (looked for at most every :data:`IDLE_CHECK_S`;
        ``busy`` is called only then)."""
        now = time.monotonic()
        if now < self._idle_check_at:
            return
        self._idle_check_at = now + min(IDLE_CHECK_S, PEER_IDLE_S / 4)
        for pid in self.peers.idle(now, PEER_IDLE_S, busy()):
            self.forget(pid, f"unused for more than PEER_IDLE_S={PEER_IDLE_S:g} s")

    def forget(self, pid: PeerId, why: str) -> None:
        """Drop a peer no pull needs: its NIXL remote agent, and its fence connection unless another peer
        (another engine id or rank claimed at the same address) still uses ``host:port``."""
        if self.peers.drop(pid) is None:
            return
        logger.info("p2pkv: dropped peer %s: %s", pid, why)
        if not any((p.host, p.port) == (pid.host, pid.port) for p in [*self.peers.peers, *self.peers.handshakes]):
            self.fence.forget(pid.host, pid.port)
