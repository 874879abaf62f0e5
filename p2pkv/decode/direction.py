"""Which way a prefill rank's bytes move for a pull: the decode rank READs (pull) or the prefill rank WRITEs (push).

``transfer_mode`` (:class:`p2pkv.config.P2pKvConfig`) is ``pull``, ``push``
or ``auto``; a request may name one in ``kv_transfer_params``
(``p2pkv_transfer_mode``). ``auto`` pulls from a peer until UCX has said how
it moves that peer's READs (:class:`p2pkv.dataplane.transport.TransportReport`,
learned from the first READ), then keeps pulling where the READ is zero-copy
(cma, cuda_ipc, RDMA verbs) and pushes where it is not (GPU memory over TCP,
the case where UCX turns ``cuda_ipc`` GET off without NVLink). Pure: no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from p2pkv.dataplane.transport import TransportReport, read_is_zero_copy

TransferModeSetting = Literal["pull", "push", "auto"]
"""The ``transfer_mode`` setting (and ``kv_transfer_params.p2pkv_transfer_mode``)."""


class Direction(str, enum.Enum):
    """Who posts the NIXL xfer of a prefill rank's share of a pull."""

    PULL = "pull"
    """The decode rank READs from the prefill rank's blocks."""
    PUSH = "push"
    """The prefill rank WRITEs into the decode rank's blocks (or staging) when asked."""


@dataclass(frozen=True)
class Choice:
    """A direction and why (logged once per peer, and the metric label is ``direction``)."""

    direction: Direction
    reason: str


def choose(setting: TransferModeSetting, report: TransportReport | None) -> Choice:
    """The direction for one prefill rank under ``setting``, given what UCX reported for its READs.

    Args:
        setting: ``pull``, ``push`` or ``auto``.
        report: the peer's READ transport (None: no READ from it finished yet).
    """
    if setting != "auto":
        return Choice(Direction(setting), f"transfer_mode={setting}")
    if report is None:
        return Choice(Direction.PULL, "auto: no READ from this peer yet, so pulling until UCX says how READs move")
    if report.transport == "unknown":
        return Choice(Direction.PULL, f"auto: UCX reported no transport for READs of {report.mem_type}; pulling")
    if read_is_zero_copy(report):
        return Choice(Direction.PULL, f"auto: READs of {report.mem_type} move by {report.transport} (zero-copy)")
    return Choice(Direction.PUSH, f"auto: READs of {report.mem_type} move by {report.transport}, not zero-copy; "
                                  "the prefill rank WRITEs instead")

