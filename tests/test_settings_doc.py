"""docs/settings.md lists every p2pkv setting, and only those, once, in "Set these" or "Tuning", with the default
the code has; its "Constants" list names every removed setting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from p2pkv.config import REMOVED, P2pKvConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"

TABLES = ("Set these", "Tuning")
"""The two tables, by their headings: what a deployment sets, and what it may tune."""

MOST_TO_SET = 7
"""At most this many settings a deployment needs (the side channel's address, the secret, the role, the mode)."""


def sections(text: str) -> dict[str, str]:
    """``## heading`` → the text under it."""
    parts = re.split(r"(?m)^## (.+)$", text)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def table(section: str) -> dict[str, str]:
    """Setting key → its default cell, from a section's table: one key per row."""
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`([a-z_0-9]+)`", cells[0])
        assert len(keys) == 1, f"row {cells[0]}: one setting per line"
        assert keys[0] not in out, f"{keys[0]} has two lines"
        assert all(cells[:4]), f"row {cells[0]}: key, default, meaning and when to change it"
        out[keys[0]] = cells[1]
    return out


def tables(text: str) -> dict[str, dict[str, str]]:
    found = sections(text)
    missing = [t for t in TABLES if t not in found]
    assert not missing, f"docs/settings.md has no section {missing}"
    return {t: table(found[t]) for t in TABLES}


def check(text: str) -> None:
    """Raise AssertionError where ``text`` (a settings doc) and :class:`P2pKvConfig` disagree."""
    by_table = tables(text)
    both = set(by_table["Set these"]) & set(by_table["Tuning"])
    assert not both, f"in both tables: {both}"
    assert len(by_table["Set these"]) <= MOST_TO_SET, f"more than {MOST_TO_SET} to set: {by_table['Set these']}"
    rows = {**by_table["Set these"], **by_table["Tuning"]}
    fields = {f.name for f in msgspec.structs.fields(P2pKvConfig)}
    assert set(rows) - fields == set(), f"docs/settings.md lists unknown settings: {set(rows) - fields}"
    assert fields - set(rows) == set(), f"settings missing from docs/settings.md: {fields - set(rows)}"
    defaults = {f.name: f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
                for f in msgspec.structs.fields(P2pKvConfig)}
    checked = 0
    for key, cell in rows.items():
        text_ = cell.strip("`")
        try:
            value = json.loads(text_)
        except ValueError:
            if cell.startswith("`") and re.fullmatch(r"[A-Za-z_]+", text_):
                value = text_  # a word such as `auto` or `BLHNC`
            else:
                continue  # prose: "host's IP", "from `kv_role`"
        default = defaults[key]
        if isinstance(default, tuple):
            default = list(default)
        assert value == default, f"docs/settings.md says {key} defaults to {cell}; the code says {default!r}"
        checked += 1
    assert checked >= 15, f"only {checked} defaults could be read: is each table's format key | default | ...?"
    constants = sections(text).get("Constants", "")
    named = set(re.findall(r"`([a-z_0-9]+)` →", constants))
    assert set(REMOVED) - named == set(), f"removed settings missing from Constants: {set(REMOVED) - named}"
    assert named - set(REMOVED) == set(), f"Constants names settings that were not removed: {named - set(REMOVED)}"


def test_the_doc_matches_the_settings() -> None:
    check(DOC.read_text())


def test_the_check_fails_when_the_doc_and_the_code_disagree() -> None:
    """A row dropped, a default changed, a row in both tables, a removed key missing from Constants: each fails."""
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `lease_s` |"))
    broken = {
        "row missing": text.replace(row + "\n", ""),
        "default wrong": text.replace(row, row.replace("| 120 |", "| 90 |")),
        "in both tables": text.replace("| `side_channel_host` |", row + "\n| `side_channel_host` |", 1),
        "constant missing": re.sub(r"(?m)^- `idle_wait_s` →.*\n", "", text),
        "unknown setting": text.replace(row, row + "\n| `idle_wait_s` | 0.002 | wait | never |"),
    }
    for why, doc in broken.items():
        assert doc != text, why
        with pytest.raises(AssertionError):
            check(doc)
