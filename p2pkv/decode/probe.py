"""A tiny READ from each new prefill rank, so that ``transfer_mode: auto`` knows how READs move before any KV does.

``auto`` pulls from a peer until UCX has said how its READs move, then pushes
where they are not zero-copy (:mod:`p2pkv.decode.direction`). Learning that
from a request's own READ made the first request from every prefill rank pay
the slow path: on one H200 (no NVLink peer) UCX READs GPU memory over
``tcp/lo`` at ~0.5 GB/s, so a 4k-token Llama-3-8B prompt's first transfer took
about 1 s where a push takes under 1 ms (docs/benchmarks/transfer-h200.md).

UCX writes its protocol selection for a (endpoint configuration, operation,
memory types) key once, covering every message size, so a READ of a few bytes
yields the same report a prompt's READ would. The probe READs
:data:`PROBE_BYTES` from the start of the peer's first registered region (its
KV cache: READs change nothing there) into a small buffer of this rank's own,
registered once on the KV cache's device, right after the handshake and
before the peer's first part is planned; the agent hands the report on as
after any READ (:attr:`p2pkv.dataplane.agent.NixlTransferAgent.on_transport`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from p2pkv.dataplane.agent import NixlTransferAgent, TransferError
from p2pkv.dataplane.layout import Region
from p2pkv.decode.peers import Peer

logger = logging.getLogger("p2pkv.decode")

PROBE_BYTES = 4096
"""Bytes of the probe READ (at most the peer's first region)."""

PROBE_REMEMBERED = 1024
"""Remote agents whose failed probe is remembered (the oldest forgotten first), at most."""

PROBE_TIMEOUT_S = 1.0
"""How long a probe may take (seconds) before it is cancelled; the peer is then pulled from until a READ reports."""


class TransportProbe:
    """Probes each new prefill rank with one small READ (see the module docstring).

    Args:
        agent: the decode rank's NIXL agent (its ``mem_type`` is the probe buffer's).
        device: the KV cache's torch device; the probe buffer (``uint8 [PROBE_BYTES]``) lives there and is
            registered with ``agent`` now, before any peer loads this rank's metadata.
        device_id: NIXL device id of that buffer (the GPU index; 0 for host memory).
        timeout_s: how long one probe may take (seconds).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, agent: NixlTransferAgent, device: torch.device, device_id: int,
                 timeout_s: float = PROBE_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.agent, self.device_id, self.timeout_s, self.clock = agent, device_id, timeout_s, clock
        self.buffer = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
        agent.register([Region(self.buffer.data_ptr(), PROBE_BYTES)], agent.mem_type, device_id)
        self.failed: dict[str, None] = {}
        """Remote agents whose probe READ failed or was late (not probed again while loaded); the last
        :data:`PROBE_REMEMBERED`. One that finished is known by the agent's transport report."""

    def run(self, peer: Peer) -> None:
        """READ a few bytes from ``peer`` once per remote agent; the agent reports the transport when it is done.

        Never raises: a probe that fails or takes longer than ``timeout_s`` is
        logged and cancelled, and the peer is pulled from until a request's READ reports.
        """
        if peer.agent_name in self.failed or peer.agent_name in self.agent.transports:
            return
        regions = [r for r in peer.info.layout.regions if r.length > 0]
        if not regions:  # nothing registered to READ from: its first request's READ (if any) reports
            self._failed(peer.agent_name)
            return
        region = regions[0]
        nbytes = min(PROBE_BYTES, region.length)
        local = np.array([[self.buffer.data_ptr(), nbytes, self.device_id]], dtype=np.uint64)
        remote = np.array([[region.base_addr, nbytes, region.device_id]], dtype=np.uint64)
        started = self.clock()
        try:
            xfer = self.agent.start_read(peer.agent_name, local, remote)
            while not self.agent.poll(xfer):
                if self.clock() - started > self.timeout_s:
                    self.agent.cancel(xfer)
                    raise TransferError(f"not done within {self.timeout_s:g} s")
                time.sleep(0.0005)
        except TransferError as exc:
            self._failed(peer.agent_name)
            logger.warning("p2pkv: probe READ from prefill agent %s failed (%s); pulling from it until a "
                           "request's READ says how READs move", peer.agent_name, exc)
            return
        logger.debug("p2pkv: probe READ from %s took %.2f ms", peer.agent_name, (self.clock() - started) * 1e3)

    def forget(self, agent_name: str) -> None:
        """The prefill agent left NIXL: probe it again if it is loaded again."""
        self.failed.pop(agent_name, None)

    def _failed(self, agent_name: str) -> None:
        while len(self.failed) >= PROBE_REMEMBERED:
            del self.failed[next(iter(self.failed))]
        self.failed[agent_name] = None
