"""Compatibility fingerprints: what two engines must share to exchange KV, compared field by field.

A fingerprint is canonical JSON of ``{field: value}`` (strings), built by
:func:`fingerprint` from whatever the caller says must match (p2pkv:
:func:`p2pkv.connector.compat_fields`). It travels as
``AgentInfo.compat_hash``; the decode side compares the prefill's with its
own (:func:`mismatches`) and refuses the peer before any READ, naming each
differing field with both values. A fingerprint that is not such JSON
compares as one opaque value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

OPAQUE = "compat_hash"
"""The field name a mismatch of opaque (non-JSON) fingerprints is reported under."""


def fingerprint(fields: Mapping[str, object]) -> str:
    """Canonical JSON of ``fields`` (values as strings, keys sorted): equal fields give equal strings."""
    return json.dumps({str(k): str(v) for k, v in fields.items()}, sort_keys=True, separators=(",", ":"))


def _fields(fp: str) -> dict[str, str] | None:
    try:
        value = json.loads(fp)
    except ValueError:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return None
    return value


def mismatches(mine: str, theirs: str) -> list[tuple[str, str, str]]:
    """``(field, my value, their value)`` for each field the two fingerprints disagree on, sorted by field.

    A field only one side has counts as a mismatch (the other value is
    ``"<absent>"``). Fingerprints that are not both :func:`fingerprint`
    JSON are compared whole, as the field :data:`OPAQUE`.
    """
    if mine == theirs:
        return []
    a, b = _fields(mine), _fields(theirs)
    if a is None or b is None:
        return [(OPAQUE, mine, theirs)]
    return [(k, a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


def describe(diffs: list[tuple[str, str, str]], mine: str = "this side", theirs: str = "the peer") -> str:
    """One line naming every mismatch: ``field: <theirs> has X, <mine> has Y; ...`` (values cut at 128 chars)."""
    return "; ".join(f"{k}: {theirs} has {t[:128]!r}, {mine} has {m[:128]!r}" for k, m, t in diffs)
