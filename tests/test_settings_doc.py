"""docs/settings.md lists every p2pkv setting, and only those, with the default the code has."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec

from p2pkv.config import P2pKvConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def rows() -> dict[str, str]:
    """Setting key → its default cell; a row naming two keys (``a`` / ``b``, ``x / y``) gives one entry each."""
    out: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`([a-z_0-9]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(" / ")] if len(keys) > 1 else [cells[1]]
        assert len(defaults) == len(keys), f"row {cells[0]}: {len(keys)} keys, defaults {cells[1]!r}"
        out.update(zip(keys, defaults, strict=True))
    return out


def test_every_setting_is_documented_and_nothing_else() -> None:
    fields = {f.name for f in msgspec.structs.fields(P2pKvConfig)}
    documented = set(rows())
    assert documented - fields == set(), f"docs/settings.md lists unknown settings: {documented - fields}"
    assert fields - documented == set(), f"settings missing from docs/settings.md: {fields - documented}"


def test_literal_defaults_are_the_codes() -> None:
    """A default written as a literal (number, boolean, ``""``, a JSON list, a `word`) is the field's default."""
    defaults = {f.name: f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
                for f in msgspec.structs.fields(P2pKvConfig)}
    checked = 0
    for key, cell in rows().items():
        text = cell.strip("`")
        try:
            value = json.loads(text)
        except ValueError:
            if cell.startswith("`") and re.fullmatch(r"[A-Za-z_]+", text):
                value = text  # a word such as `auto` or `BLHNC`
            else:
                continue  # prose: "host's IP", "`lease_s`/4", "from `kv_role`"
        default = defaults[key]
        if isinstance(default, tuple):
            default = list(default)
        assert value == default, f"docs/settings.md says {key} defaults to {cell}; the code says {default!r}"
        checked += 1
    assert checked >= 25, f"only {checked} defaults could be read: is the table's format still key | default | meaning?"
