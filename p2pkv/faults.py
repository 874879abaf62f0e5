"""Fault injection for operators: faults a decode rank injects into what lands, each with a probability.

Off unless set, and refused unless allowed: a fault is named by an
environment variable ``P2PKV_FAULT_<NAME>`` holding its probability (0 to
1, per part landed), and any fault set to more than 0 without
``P2PKV_ALLOW_FAULTS=1`` in the same environment stops the engine at start
(:class:`p2pkv.config.ConfigError`), so a variable copied into a production
deployment by mistake never corrupts a user's answer. An unknown
``P2PKV_FAULT_*`` variable is refused too (a typo would otherwise inject
nothing while the operator believes it does).

Faults:

- ``P2PKV_FAULT_CORRUPT_LANDED``: overwrite the first bytes of a part's
  first row (up to :data:`CORRUPT_BYTES`) with :data:`CORRUPT_BYTE` (0.75 in
  float32 and bfloat16 KV: wrong values, not NaN, so the engine answers)
  right after it lands, before it is checked and fixed up: what verified KV
  (``verify_kv``) must catch, and what changes the answer when it is off.

- ``P2PKV_FAULT_DROP_READ``: post a part's READ as one byte of its first
  row, so the rest of its blocks keep what they held before (stale KV, or
  another request's): a READ that did not happen, reported done.

``P2PKV_FAULT_REQUESTS``, when set, aims every fault at the requests whose
id contains it (vLLM's request id holds a client's ``X-Request-Id``), so
tests corrupt chosen requests of a shared engine and leave the others alone.

Used by tests through real engines (docs/reliability.md, "Fault injection").
"""

from __future__ import annotations

import ctypes
import os
import random
from dataclasses import dataclass, field

import numpy as np

from p2pkv.config import ConfigError

PREFIX = "P2PKV_FAULT_"
"""What a fault's environment variable starts with."""
ALLOW = "P2PKV_ALLOW_FAULTS"
"""The variable that must be ``1`` for any fault to be set."""
NAMES = ("corrupt_landed", "drop_read")
"""Every fault, by the lower-case name after :data:`PREFIX`."""
REQUESTS = PREFIX + "REQUESTS"
"""The variable that aims the faults at the requests whose id contains its value (unset: every request)."""
CORRUPT_BYTES = 65536
"""Most bytes ``corrupt_landed`` overwrites."""
CORRUPT_BYTE = 0x3F
"""The byte ``corrupt_landed`` writes: ``0x3F3F3F3F`` is 0.75 as float32, ``0x3F3F`` 0.75 as bfloat16."""


@dataclass(frozen=True)
class Faults:
    """The faults a rank injects, each a probability per part (0: never).

    Attributes:
        corrupt_landed: overwrite the start of a part's first row with :data:`CORRUPT_BYTE` once it has landed.
        drop_read: post a part's READ as one byte of its first row (the rest of its blocks left stale).
        requests: aim the faults at request ids containing this (``""``: every request).
        rng: the random draws (seeded by tests).
    """

    corrupt_landed: float = 0.0
    drop_read: float = 0.0
    requests: str = ""
    rng: random.Random = field(default_factory=random.Random, compare=False)

    @property
    def any(self) -> bool:
        """Whether any fault may fire."""
        return self.corrupt_landed > 0 or self.drop_read > 0

    def _fires(self, probability: float, request_id: str) -> bool:
        """One draw of a fault of ``probability`` for ``request_id`` (never for a request it is not aimed at)."""
        return bool(probability) and self.requests in request_id and self.rng.random() < probability

    def read_rows(self, local: np.ndarray, remote: np.ndarray, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """The rows a part's READ moves: ``(local, remote)`` as given, or, when ``drop_read`` fires, one byte of
        their first row (uint64 ``[1, 3]`` each)."""
        if not local.shape[0] or not self._fires(self.drop_read, request_id):
            return local, remote
        one_local, one_remote = local[:1].copy(), remote[:1].copy()
        one_local[0, 1] = one_remote[0, 1] = 1
        return one_local, one_remote

    def corrupt(self, rows: np.ndarray, request_id: str = "") -> bool:
        """With probability :attr:`corrupt_landed` (for a request it aims at), overwrite the first bytes ``rows``
        name (at most :data:`CORRUPT_BYTES` of the first row) with :data:`CORRUPT_BYTE`.

        Args:
            rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)`` of host memory this process owns (landed KV).
            request_id: the request the rows belong to.

        Returns:
            True when bytes were overwritten.
        """
        if not rows.shape[0] or int(rows[0, 0]) == 0 or not self._fires(self.corrupt_landed, request_id):
            return False
        length = min(int(rows[0, 1]), CORRUPT_BYTES)
        ctypes.memset(int(rows[0, 0]), CORRUPT_BYTE, length)
        return True


def load_faults(environ: dict[str, str] | None = None) -> Faults:
    """The faults ``environ`` (default ``os.environ``) sets.

    Raises:
        ConfigError: an unknown ``P2PKV_FAULT_*`` variable, a probability that is not a number in [0, 1], or a
            fault above 0 without ``P2PKV_ALLOW_FAULTS=1`` (each message names the variable and the fix).
    """
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, float] = {}
    for variable, raw in environ.items():
        if not variable.startswith(PREFIX) or variable == REQUESTS:
            continue
        name = variable[len(PREFIX):].lower()
        if name not in NAMES:
            known = ", ".join(PREFIX + n.upper() for n in NAMES)
            raise ConfigError(f"{variable} is not a p2pkv fault (known: {known}); unset it")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{variable}={raw!r} is not a probability; set a number in [0, 1]") from None
        if not 0 <= value <= 1:
            raise ConfigError(f"{variable}={raw!r} is not a probability; set a number in [0, 1]")
        values[name] = value
    if any(values.values()) and environ.get(ALLOW) != "1":
        set_ = ", ".join(f"{PREFIX}{n.upper()}" for n, v in values.items() if v)
        raise ConfigError(f"{set_} injects faults into served requests; set {ALLOW}=1 as well to allow it "
                          "(test deployments only), or unset it")
    return Faults(**values, requests=environ.get(REQUESTS, ""))
