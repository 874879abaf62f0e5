"""The order of ``parse_remote_prefill``'s checks: expiry, counts, the MAC over the lists as they came, then the ids.

A forged capability once cost a decode engine's EngineCore milliseconds (2 ms at 4k tokens, 57 ms at 128k on
a 2-core VM) before it was refused: every id of up to 64 KV cache groups was type-checked and the MAC
computed over them all, and only then was the group count compared with the engine's. The speed is the
benchmark's (scripts/bench_refusal.py, whose cases are run here untimed); here the order is proved by making the
later checks fail the test if they run.
"""

from __future__ import annotations

import logging
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import p2pkv.params as params_module
from p2pkv.params import (
    CAPABILITY_KEY,
    MAX_BLOCK_ID,
    KVTransferParamsError,
    RemotePrefill,
    capability_mac,
    make_prefill_response_params,
    parse_remote_prefill,
)

SECRET = b"a-side-channel-secret-of-32-byte"
NOW = 1_800_000_000.0
EXPIRY = int(NOW) + 60
FORGED = f"v1.{EXPIRY}.{'0' * 64}"
"""A capability of the right form, within the lifetime cap, with a MAC nobody computed."""


def _params(groups: list[list[int]], *, secret: bytes | None = SECRET, **kw: object) -> dict:
    """Params a prefill engine signed (with ``secret``) for ``groups``, as NixlConnector's per-group lists."""
    args: dict = {"engine_id": "prefill-0", "request_id": "cmpl-abc-0", "host": "127.0.0.1", "port": 5600,
                  "block_ids": [b for g in groups for b in g], "group_sizes": [len(g) for g in groups],
                  "tp_size": 1, "num_tokens": 0, "expiry_time": EXPIRY, "secret": secret, **kw}
    return make_prefill_response_params(**args)


def _mac_over(params: dict, groups: list[list[object]]) -> str:
    """A capability whose MAC covers ``groups`` exactly as given (no id checked): what only a holder of the
    secret could make, and no prefill engine does for ids that are not block ids."""
    remote = RemotePrefill("prefill-0", "cmpl-abc-0", "127.0.0.1", 5600, tuple(b for g in groups for b in g), 1,
                           group_sizes=tuple(len(g) for g in groups) if len(groups) > 1 else ())
    return f"v1.{EXPIRY}.{capability_mac(remote, EXPIRY, SECRET)}"  # type: ignore[arg-type]


@pytest.fixture
def no_mac(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if a MAC is computed."""
    def refuse(*_: object) -> str:
        raise AssertionError("the MAC was computed before a cheap refusal")

    monkeypatch.setattr(params_module, "_fields_mac", refuse)
    monkeypatch.setattr(params_module, "capability_mac", refuse)


@pytest.fixture
def no_id_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if any block id is type- or range-checked."""
    def refuse(*_: object) -> tuple[int, ...]:
        raise AssertionError("block ids were checked before the MAC")

    monkeypatch.setattr(params_module, "_check_ids", refuse)


@pytest.mark.parametrize("groups", [2, 64])
def test_more_groups_than_the_engine_has_are_refused_before_the_mac(no_mac: None, no_id_check: None,
                                                                    groups: int) -> None:
    """With the message DecodeLoad.of gives; no MAC computed, no id looked at."""
    params = {**_params([[1, 2]], secret=None), "remote_block_ids": [[1, 2]] * groups, CAPABILITY_KEY: FORGED}
    with pytest.raises(KVTransferParamsError, match=f"remote_block_ids has {groups} KV cache group\\(s\\), this "
                                                    "engine has 1: run prefill and decode with the same model"):
        parse_remote_prefill(params, secret=SECRET, now=NOW, kv_groups=1)
    with pytest.raises(KVTransferParamsError, match="KV cache group"):  # no secret: counted all the same
        parse_remote_prefill(params, secret=None, kv_groups=1)


@pytest.mark.parametrize(("value", "message"), [
    ([list(range(9))], r"remote_block_ids\[0\] must be a list of at most 8 block ids \(got 9\)"),
    (list(range(9)), r"remote_block_ids must be a list of at most 8 block ids \(got 9\)"),
    ([[1], list(range(9))], r"remote_block_ids\[1\] must be a list of at most 8"),
    ([[1], 2], r"remote_block_ids\[1\] must be a list"),
    ([[1]] * 65, "65 KV cache groups, more than 64"),
])
def test_every_count_is_refused_before_the_mac(no_mac: None, no_id_check: None, value: list,
                                               message: str) -> None:
    params = {**_params([[1]], secret=None), "remote_block_ids": value, CAPABILITY_KEY: FORGED}
    with pytest.raises(KVTransferParamsError, match=message):
        parse_remote_prefill(params, secret=SECRET, now=NOW, max_blocks=8)


def test_the_total_count_is_refused_before_the_mac(no_mac: None, no_id_check: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(params_module, "MAX_BLOCK_IDS", 10)
    params = {**_params([[1]], secret=None), "remote_block_ids": [[1] * 6, [1] * 5], CAPABILITY_KEY: FORGED}
    with pytest.raises(KVTransferParamsError, match="more than 10 entries"):
        parse_remote_prefill(params, secret=SECRET, now=NOW, max_blocks=8)


def test_a_forged_mac_is_refused_before_any_id_is_checked(no_id_check: None) -> None:
    params = {**_params([[1, 2, 3]], secret=None), CAPABILITY_KEY: FORGED}
    with pytest.raises(KVTransferParamsError, match=f"{CAPABILITY_KEY} does not match the params"):
        parse_remote_prefill(params, secret=SECRET, now=NOW, kv_groups=1)


BAD_IDS = [True, False, 1.0, float("nan"), "1", None, [1], {"a": 1}, -1, MAX_BLOCK_ID + 1, 2**63, 2**64 - 1, 2**64,
           2**70, -(2**64), object()]


@pytest.mark.parametrize("bad", BAD_IDS, ids=lambda v: type(v).__name__ if type(v) is object else repr(v))
def test_ids_that_are_no_block_ids_are_refused_forged_or_signed(bad: object) -> None:
    """Under a forged capability: refused (the MAC does not cover them, or they cannot be encoded as block ids),
    never with another exception. Under a MAC that covers them exactly (made with the secret; no prefill engine
    makes one): refused by the id checks that follow the MAC, naming the group."""
    groups = [[5, 6], [7, bad]]
    params = {**_params([[5, 6], [7, 8]], secret=None), "remote_block_ids": groups, CAPABILITY_KEY: FORGED}
    with pytest.raises(KVTransferParamsError, match=f"{CAPABILITY_KEY} does not match|remote_block_ids holds"):
        parse_remote_prefill(params, secret=SECRET, now=NOW, kv_groups=2)
    try:
        signed = _mac_over(params, groups)
    except (TypeError, OverflowError):  # capability_mac cannot sign it either
        return
    with pytest.raises(KVTransferParamsError, match=r"remote_block_ids(\[1\])? holds"):
        parse_remote_prefill({**params, CAPABILITY_KEY: signed}, secret=SECRET, now=NOW, kv_groups=2)


@pytest.mark.parametrize(("sent", "block_ids", "group_sizes"), [
    ([[3, 4, 9], [0, 0, 7]], (3, 4, 9, 0, 0, 7), (3, 3)),
    ([[8, 9, 10]], (8, 9, 10), ()),
    ([5, 6, 7], (5, 6, 7), ()),
    ([[1, 2], [], [3]], (1, 2, 3), (2, 0, 1)),
    ([], (), ()),
    ([[]], (), ()),
])
def test_honest_params_parse_to_the_same_remote_prefill(sent: list, block_ids: tuple, group_sizes: tuple) -> None:
    """Signed by the prefill engine (flat lists as a router may send them: signed as one group), parsed with and
    without the secret and with the engine's group count: the RemotePrefill they always gave."""
    groups = [sent] if not sent or not isinstance(sent[0], list) else sent
    params = {**_params(groups, num_tokens=40, prompt_digest="ab" * 16), "remote_block_ids": sent,
              "appended_tokens": 1, "p2pkv_transfer_mode": "push"}
    params[CAPABILITY_KEY] = f"v1.{EXPIRY}.{capability_mac(parse_remote_prefill(params, secret=None), EXPIRY, SECRET)}"
    expected = RemotePrefill("prefill-0", "cmpl-abc-0", "127.0.0.1", 5600, block_ids, 1, num_tokens=40,
                             group_sizes=group_sizes, appended_tokens=1, transfer_mode="push",
                             prompt_digest="ab" * 16)
    assert parse_remote_prefill(params, secret=SECRET, now=NOW, kv_groups=len(groups)) == expected
    assert parse_remote_prefill(params, secret=None, kv_groups=len(groups)) == expected
    assert parse_remote_prefill(params, secret=SECRET, now=NOW) == expected


group_lists = st.lists(st.lists(st.integers(0, MAX_BLOCK_ID), max_size=12), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(groups=group_lists, flat=st.booleans(), tp_size=st.integers(1, 8), num_tokens=st.integers(0, 10**6),
       digest=st.sampled_from(["", "0f" * 16]), alter=st.integers(0, 47))
def test_the_mac_computed_from_the_raw_lists_equals_capability_mac(groups: list[list[int]], flat: bool,
                                                                   tp_size: int, num_tokens: int, digest: str,
                                                                   alter: int) -> None:
    """The MAC parse_remote_prefill computes from the params' lists as they came (a flat list as one group,
    ``[[ids]]``) is capability_mac's of the RemotePrefill they parse to, which the prefill engine signed; any one
    id changed is refused."""
    params = _params(groups, tp_size=tp_size, num_tokens=num_tokens, prompt_digest=digest)
    if flat and len(groups) == 1:
        params["remote_block_ids"] = groups[0]
    seen: list[str] = []
    real = params_module._fields_mac
    with mock.patch.object(params_module, "_fields_mac", lambda f, s: seen.append(real(f, s)) or seen[-1]):
        remote = parse_remote_prefill(params, secret=SECRET, now=NOW, kv_groups=len(groups))
    assert seen == [capability_mac(remote, EXPIRY, SECRET)] == [params[CAPABILITY_KEY].rpartition(".")[2]]
    assert remote == parse_remote_prefill(params, secret=None)
    ids = [b for g in groups for b in g]
    if ids:
        i = alter % len(ids)
        ids[i] = (ids[i] + 1) % (MAX_BLOCK_ID + 1)
        sizes = [len(g) for g in groups]
        altered = [ids[sum(sizes[:k]):sum(sizes[:k + 1])] for k in range(len(groups))]
        with pytest.raises(KVTransferParamsError, match=f"{CAPABILITY_KEY} does not match"):
            parse_remote_prefill({**params, "remote_block_ids": altered}, secret=SECRET, now=NOW)


def test_the_benchmark_cases_are_refused_where_they_say() -> None:
    """scripts/bench_refusal.py's cases, run in-process at a short length: each forged or expired one is refused
    (by the check its name says) and prefilled locally; the honest one loads its prompt."""
    from tests.script_loader import load_script

    bench = load_script("bench_refusal")
    log = bench.LastLine()
    logger = logging.getLogger("p2pkv")
    logger.addHandler(log)
    try:
        got = {case: bench.run_case(case, 256, 16, reps=30, budget_s=0.01, log=log) for case in bench.CASES}
    finally:
        logger.removeHandler(log)
        log.close()
    assert {c: r["samples"] for c, r in got.items()} == dict.fromkeys(bench.CASES, 30)
    expected = {"forged-far-64g": "expires", "forged-far-1g": "expires", "forged-near-64g": "64 KV cache group",
                "forged-near-1g-int": "does not match", "forged-near-1g-bigint": "no block ids",
                "forged-near-1g-float": "no block ids", "expired-64g": "expired"}
    for case, words in expected.items():
        assert got[case]["loaded_tokens"] == 0 and words in got[case]["refused"], (case, got[case]["refused"])
    assert got["honest-1g"]["loaded_tokens"] == 256 and got["honest-1g"]["refused"] == ""
    assert got["forged-near-64g"]["ids"] == 64 * 16
