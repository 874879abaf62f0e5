"""Which way a prefill rank's bytes move for a pull: the decode rank READs (pull), the prefill rank WRITEs
(push), or the prefill rank WRITEs each layer as its forward computes it (stream).

``transfer_mode`` (:class:`p2pkv.config.P2pKvConfig`) is ``pull``, ``push``,
``auto`` or ``stream``; a request may name one in ``kv_transfer_params``
(``p2pkv_transfer_mode``). Under ``stream`` a request whose decode leg
carries a stream grant streams and one without is pushed (docs/streaming.md).
``auto`` pulls from a peer until UCX has said how it moves that peer's READs
(:class:`p2pkv.dataplane.transport.TransportReport`, learned from a probe READ
right after the handshake, :mod:`p2pkv.decode.probe`, or else from the first
READ), then keeps pulling where the READ is zero-copy
(cma, cuda_ipc, RDMA verbs) and pushes where it is not (GPU memory over TCP,
the case where UCX turns ``cuda_ipc`` GET off without NVLink). No I/O but a log
line when a peer's choice is new or changes.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Literal

from p2pkv.dataplane.transport import TransportReport, read_is_zero_copy
from p2pkv.ways import WAYS, Way

logger = logging.getLogger("p2pkv.decode")

TransferModeSetting = Literal["pull", "push", "auto", "stream"]
"""The ``transfer_mode`` setting (and ``kv_transfer_params.p2pkv_transfer_mode``)."""


class Direction(str, enum.Enum):
    """Who posts the NIXL xfer of a prefill rank's share of a pull: one value per way of :data:`p2pkv.ways.WAYS`
    (a new way is a value here and a :class:`~p2pkv.ways.Way` there)."""

    PULL = "pull"
    """The decode rank READs from the prefill rank's blocks."""
    PUSH = "push"
    """The prefill rank WRITEs into the decode rank's blocks (or staging) when asked."""
    STREAM = "stream"
    """The prefill rank WRITEs each layer into the decode rank's blocks as its forward computes it (a request
    whose legs the proxy sent at once, with a grant: docs/streaming.md)."""

    @property
    def way(self) -> Way:
        """What the registry says of this way (its requests, handler, mover and traits)."""
        return WAYS[self.value]


@dataclass(frozen=True)
class Choice:
    """A direction and why (logged once per peer, and the metric label is ``direction``)."""

    direction: Direction
    reason: str


def choose(setting: TransferModeSetting, report: TransportReport | None) -> Choice:
    """The direction for one prefill rank under ``setting``, given what UCX reported for its READs.

    Args:
        setting: ``pull``, ``push``, ``auto`` or ``stream``.
        report: the peer's READ transport (None: no READ from it finished yet).
    """
    if setting == "stream":  # a request with a grant streams (Directions.of); one without is pushed
        return Choice(Direction.PUSH, "transfer_mode=stream: requests without a stream grant are pushed")
    if setting != "auto":
        return Choice(Direction(setting), f"transfer_mode={setting}")
    if report is None:
        return Choice(Direction.PULL, "auto: no READ from this peer yet, so pulling until UCX says how READs move")
    if report.transport == "unknown":
        return Choice(Direction.PULL, f"auto: UCX reported no transport for READs of {report.mem_type} (unknown); "
                                      "pulling")
    if read_is_zero_copy(report):
        return Choice(Direction.PULL, f"auto: READs of {report.mem_type} move by {report.transport} (zero-copy)")
    return Choice(Direction.PUSH, f"auto: READs of {report.mem_type} move by {report.transport}, not zero-copy; "
                                  "the prefill rank WRITEs instead")



class Directions:
    """Each prefill agent's direction for one decode rank, under its ``transfer_mode`` setting.

    A request naming ``p2pkv_transfer_mode`` (``pull``/``push``/``stream``) gets that;
    otherwise the peer's :class:`Choice`: the setting, or under ``auto`` what
    UCX's READ report for that peer says (:meth:`on_transport`). A choice is
    logged when it is new or changes.

    Args:
        setting: the decode engine's ``transfer_mode``.
    """

    def __init__(self, setting: TransferModeSetting) -> None:
        self.setting = setting
        self.choices: dict[str, Choice] = {}  # prefill agent name → its choice

    def of(self, requested: str, agent_name: str) -> Direction:
        """The direction for a part from ``agent_name`` of a request that asked for ``requested`` (``""``: none)."""
        if requested in ("pull", "push", "stream"):
            return Direction(requested)
        choice = self.choices.get(agent_name)  # one look: forget() may run on another thread
        if choice is None:
            choice = choose(self.setting, None)
            self._choose(agent_name, choice)
        return choice.direction

    def on_transport(self, report: TransportReport) -> None:
        """UCX said how one peer's READs move: under ``auto`` that decides the peer's direction from now on."""
        if self.setting == "auto" and report.op == "READ":
            self._choose(report.peer, choose("auto", report))

    def forget(self, agent_name: str) -> None:
        """The prefill agent left NIXL: its choice goes (a new one is made if it comes back). Any thread."""
        self.choices.pop(agent_name, None)

    def _choose(self, name: str, choice: Choice) -> None:
        if self.choices.get(name) != choice:
            logger.info("p2pkv: %s from prefill agent %s (%s)", choice.direction.value, name, choice.reason)
        self.choices[name] = choice
