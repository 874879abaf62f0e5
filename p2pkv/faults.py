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

- ``P2PKV_FAULT_CORRUPT_LANDED``: flip one byte of a part's first row right
  after it lands, before it is checked and fixed up: what verified KV
  (``verify_kv``) must catch, and what changes the answer when it is off.

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
NAMES = ("corrupt_landed",)
"""Every fault, by the lower-case name after :data:`PREFIX`."""


@dataclass(frozen=True)
class Faults:
    """The faults a rank injects, each a probability per part (0: never).

    Attributes:
        corrupt_landed: flip one byte of a part's first row once it has landed (host memory only).
        rng: the random draws (seeded by tests).
    """

    corrupt_landed: float = 0.0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    @property
    def any(self) -> bool:
        """Whether any fault may fire."""
        return self.corrupt_landed > 0

    def corrupt(self, rows: np.ndarray) -> bool:
        """With probability :attr:`corrupt_landed`, flip every bit of the first byte ``rows`` name (host memory).

        Args:
            rows: uint64 ``[n, 3]`` ``(addr, bytes, device_id)`` of memory this process owns (landed KV).

        Returns:
            True when a byte was flipped.
        """
        if not self.corrupt_landed or not rows.shape[0] or int(rows[0, 0]) == 0:
            return False
        if self.rng.random() >= self.corrupt_landed:
            return False
        byte = ctypes.c_uint8.from_address(int(rows[0, 0]))
        byte.value ^= 0xFF
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
        if not variable.startswith(PREFIX):
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
    return Faults(**values)
