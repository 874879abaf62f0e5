"""Fault injection for operators: faults a rank injects into the KV it moves, each with a probability.

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

- ``P2PKV_FAULT_STALE_READ``: READ each row of a part from the next row's
  source of the same size (the rows rolled by one), so its blocks get
  bytes of other blocks: KV handed back from blocks that are not the
  request's (a READ after the blocks were reused). A part of one row, or
  of rows of different sizes only, is READ as asked.

- ``P2PKV_FAULT_DELAY_READ``: report a READ that has landed as still in
  flight for ``P2PKV_FAULT_DELAY_S`` seconds more (default
  :data:`DELAY_S`): a slow READ, which the load's ``transfer_timeout_s``
  must end when it is longer.

- ``P2PKV_FAULT_DROP_WRITE`` (a prefill rank: push and layer streams):
  post a WRITE as one byte of its first row, so the decode rank's blocks
  keep what they held (a WRITE that did not happen, notified done). The
  digest the WRITE's notification carries is still of the whole rows.

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
NAMES = ("corrupt_landed", "drop_read", "stale_read", "delay_read", "drop_write")
"""Every fault, by the lower-case name after :data:`PREFIX`."""
REQUESTS = PREFIX + "REQUESTS"
"""The variable that aims the faults at the requests whose id contains its value (unset: every request)."""
DELAY = PREFIX + "DELAY_S"
"""The variable that sets how long ``delay_read`` holds a landed READ back (seconds)."""
DELAY_S = 1.0
"""``delay_read``'s delay without :data:`DELAY` (seconds)."""
MAX_DELAY_S = 600.0
"""The longest delay :data:`DELAY` may ask (seconds)."""
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
        stale_read: READ each row of a part from the next row's source of the same size.
        delay_read: report a landed READ in flight for :attr:`delay_s` more.
        drop_write: post a WRITE (push or layer stream) as one byte of its first row.
        delay_s: ``delay_read``'s delay (seconds).
        requests: aim the faults at request ids containing this (``""``: every request).
        rng: the random draws (seeded by tests).
    """

    corrupt_landed: float = 0.0
    drop_read: float = 0.0
    stale_read: float = 0.0
    delay_read: float = 0.0
    drop_write: float = 0.0
    delay_s: float = DELAY_S
    requests: str = ""
    rng: random.Random = field(default_factory=random.Random, compare=False)

    @property
    def any(self) -> bool:
        """Whether any fault may fire."""
        return any(getattr(self, name) > 0 for name in NAMES)

    def _fires(self, probability: float, request_id: str) -> bool:
        """One draw of a fault of ``probability`` for ``request_id`` (never for a request it is not aimed at)."""
        return bool(probability) and self.requests in request_id and self.rng.random() < probability

    def read_rows(self, local: np.ndarray, remote: np.ndarray, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """The rows a part's READ moves: ``(local, remote)`` as given; when ``drop_read`` fires, one byte of
        their first row (uint64 ``[1, 3]`` each); else, when ``stale_read`` fires, ``remote`` rolled by one
        among rows of the same size (:func:`rolled`).

        Args:
            local, remote: uint64 ``[n, 3]`` ``(addr, bytes, device_id)``, row ``i`` of one into row ``i`` of the
                other.
            request_id: the request the READ is for.
        """
        if not local.shape[0]:
            return local, remote
        if self._fires(self.drop_read, request_id):
            return one_byte(local), one_byte(remote)
        if self.stale_read and self._fires(self.stale_read, request_id):
            return local, rolled(remote)
        return local, remote

    def write_rows(self, source: np.ndarray, target: np.ndarray, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """The rows a WRITE moves: ``(source, target)`` as given, or, when ``drop_write`` fires, one byte of their
        first row (uint64 ``[1, 3]`` each)."""
        if not source.shape[0] or not self._fires(self.drop_write, request_id):
            return source, target
        return one_byte(source), one_byte(target)

    def delay(self, request_id: str) -> float:
        """How long a READ of ``request_id`` that has landed is still reported in flight (seconds; 0: not
        delayed), one draw of ``delay_read``."""
        return self.delay_s if self._fires(self.delay_read, request_id) else 0.0

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


def one_byte(rows: np.ndarray) -> np.ndarray:
    """The first byte of ``rows``' first row (uint64 ``[1, 3]``; ``rows`` uint64 ``[n >= 1, 3]``)."""
    first = rows[:1].copy()
    first[0, 1] = 1
    return first


def rolled(rows: np.ndarray) -> np.ndarray:
    """``rows`` with each row's address taken from the next row of the same size (the last such from the first),
    sizes and devices unchanged: every byte still within the rows given (uint64 ``[n, 3]`` in and out).
    Rows of a size no other row has keep their address."""
    out = rows.copy()
    for size in np.unique(rows[:, 1]):
        same = np.flatnonzero(rows[:, 1] == size)
        if same.size > 1:
            out[same, 0] = rows[np.roll(same, -1), 0]
            out[same, 2] = rows[np.roll(same, -1), 2]
    return out


def load_faults(environ: dict[str, str] | None = None) -> Faults:
    """The faults ``environ`` (default ``os.environ``) sets.

    Raises:
        ConfigError: an unknown ``P2PKV_FAULT_*`` variable, a probability that is not a number in [0, 1], or a
            fault above 0 without ``P2PKV_ALLOW_FAULTS=1`` (each message names the variable and the fix).
    """
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, float] = {}
    for variable, raw in environ.items():
        if not variable.startswith(PREFIX) or variable in (REQUESTS, DELAY):
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
    raw = environ.get(DELAY)
    delay_s = DELAY_S
    if raw is not None:
        try:
            delay_s = float(raw)
        except ValueError:
            delay_s = -1.0
        if not 0 < delay_s <= MAX_DELAY_S:
            raise ConfigError(f"{DELAY}={raw!r} is not a delay; set seconds in (0, {MAX_DELAY_S:g}]")
    return Faults(**values, delay_s=delay_s, requests=environ.get(REQUESTS, ""))
