"""The systems ``p2pkv bench serve`` compares, and which of them share engines.

A system is what the benchmark's client talks to: a proxy in front of a
prefill/decode pair, or one aggregated engine. The p2pkv systems differ only
in the proxy's ``--transfer-mode`` (which direction every decode leg asks
for, ``kv_transfer_params.p2pkv_transfer_mode``), so they run on one pair of
engines, each behind its own proxy (:func:`plan_groups`). Pure: nothing is
started here (see :mod:`p2pkv.tools.bench.serve_launch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SystemSpec:
    """One system of the benchmark.

    Attributes:
        name: its name on the command line and in the results.
        label: what it is, for tables and plots.
        connector: the pair's KV connector (``"p2pkv"`` or ``"nixl"``), or
            None for one aggregated engine without a connector.
        transfer_mode: the proxy's ``--transfer-mode`` (``"pull"``: the decode
            engine READs; ``"push"``: the prefill engine WRITEs into the decode
            engine's blocks); ``""``: the proxy does not ask, the decode
            engine's ``transfer_mode`` setting decides (``auto``).
    """

    name: str
    label: str
    connector: str | None
    transfer_mode: str = ""

    @property
    def disaggregated(self) -> bool:
        """A prefill/decode pair behind the proxy (not one engine)."""
        return self.connector is not None


SYSTEM_SPECS: dict[str, SystemSpec] = {spec.name: spec for spec in (
    SystemSpec("p2pkv-pull", "p2pkv P/D pair, decode READs (proxy --transfer-mode pull)", "p2pkv", "pull"),
    SystemSpec("p2pkv-push", "p2pkv P/D pair, prefill WRITEs (proxy --transfer-mode push)", "p2pkv", "push"),
    SystemSpec("nixl", "NixlConnector P/D pair + proxy", "nixl"),
    SystemSpec("aggregated", "one aggregated engine", None),
    SystemSpec("p2pkv", "p2pkv P/D pair, the decode engine's transfer_mode (auto)", "p2pkv"),
)}
"""Every system this benchmark can run, by name."""

SYSTEMS = tuple(SYSTEM_SPECS)
"""``--systems`` choices."""

DEFAULT_SYSTEMS = ("p2pkv-pull", "p2pkv-push", "nixl", "aggregated")
"""The systems of a run without ``--systems``, in this order."""

P2PKV_SYSTEMS = tuple(n for n, s in SYSTEM_SPECS.items() if s.connector == "p2pkv")
"""The p2pkv systems (the targets are checked for each of them)."""

SYSTEM_LABELS = {n: s.label for n, s in SYSTEM_SPECS.items()}
"""System name → what it is."""

EXPECTED_DIRECTION = {n: s.transfer_mode for n, s in SYSTEM_SPECS.items() if s.connector == "p2pkv" and s.transfer_mode}
"""p2pkv system → the direction every one of its transfers must have taken (checked on the decode
engine's ``p2pkv:pulls_by_direction_total``)."""

PUSH_BASELINE = "p2pkv-pull"
"""What ``p2pkv-push`` is compared with: the same engines, the decode engine READing."""


def plan_groups(systems: Sequence[str], share_engines: bool = True) -> list[tuple[str, ...]]:
    """Which systems run on which engines, in run order.

    Args:
        systems: the systems, in the order asked for (names of :data:`SYSTEM_SPECS`).
        share_engines: let the p2pkv systems share one pair (each behind its
            own proxy). False (e.g. with prefix caching on, where one system's
            run would leave the other's prompts cached) gives each its own pair.

    Returns:
        Groups of system names; each group is one set of engines, started
        once, its systems measured back to back. Shared p2pkv systems run at
        the place of the first of them.
    """
    groups: list[tuple[str, ...]] = []
    shared = [n for n in systems if SYSTEM_SPECS[n].connector == "p2pkv"] if share_engines else []
    for name in systems:
        if name in shared:
            if name == shared[0]:
                groups.append(tuple(shared))
        else:
            groups.append((name,))
    return groups
