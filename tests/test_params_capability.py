"""kv_transfer_params as a capability: signed by the prefill engine, checked by the decode engine.

Whoever reaches the decode engine's HTTP API chooses its kv_transfer_params;
without the secret they cannot make params that pass the check.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from p2pkv.params import (
    CAPABILITY_KEY,
    CLOCK_SKEW_S,
    DEFAULT_MAX_LIFETIME_S,
    MAX_BLOCK_ID,
    MAX_PP_SIZE,
    KVTransferParamsError,
    check_capability,
    make_prefill_response_params,
    parse_remote_prefill,
    sign_params,
    with_appended_tokens,
)
from p2pkv.prompt_digest import prompt_digest
from p2pkv.scheduling.load import DecodeLoad

SECRET = b"a-side-channel-secret-of-32-byte"
NOW = 1_800_000_000.0


def _signed(**kw: object) -> dict:
    args: dict = {"engine_id": "prefill-0", "request_id": "cmpl-abc-0", "host": "127.0.0.1", "port": 5600,
                  "block_ids": [3, 4, 9, 0, 0, 7], "group_sizes": [3, 3], "tp_size": 2, "num_tokens": 90,
                  "expiry_time": NOW + 120}
    args.update(kw)
    return sign_params(make_prefill_response_params(**args), SECRET, NOW + 120)


def test_signed_params_parse_and_carry_one_extra_field() -> None:
    params = _signed()
    assert params[CAPABILITY_KEY].startswith(f"v1.{int(NOW) + 120}.")
    unsigned = {k: v for k, v in params.items() if k != CAPABILITY_KEY}
    assert parse_remote_prefill(params, secret=SECRET, now=NOW) == parse_remote_prefill(unsigned, secret=None)


@pytest.mark.parametrize(("key", "value"), [
    ("remote_engine_id", "prefill-1"),
    ("remote_request_id", "cmpl-abd-0"),
    ("remote_host", "127.0.0.2"),
    ("remote_port", 5601),
    ("tp_size", 1),
    ("pp_size", 2),  # which workers hold the KV, each stage its layers
    ("remote_num_tokens", 89),
    ("remote_block_ids", [[3, 4, 8], [0, 0, 7]]),
    ("remote_block_ids", [[3, 4], [9, 0, 0, 7]]),  # same ids, other groups
    (CAPABILITY_KEY, "v1.1800000120." + "0" * 64),
    ("appended_tokens", 1),  # which tokens the KV stands for: covered since the proxy signs what it appends
    ("remote_prompt_digest", "0" * 32),
])
def test_any_change_to_what_a_pull_uses_is_refused(key, value) -> None:
    with pytest.raises(KVTransferParamsError, match=CAPABILITY_KEY):
        parse_remote_prefill({**_signed(), key: value}, secret=SECRET, now=NOW)


def test_fields_a_pull_does_not_use_may_change() -> None:
    """Routers may rewrite the flags they own and add their own keys (llm-d's sidecar rewrites do_remote_decode /
    do_remote_prefill, vLLM's router copies the params): the capability still holds."""
    params = {**_signed(), "do_remote_decode": True, "do_remote_prefill": False, "first_token": True, "x-router": "a",
              "p2pkv_transfer_mode": "push", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert parse_remote_prefill(params, secret=SECRET, now=NOW).transfer_mode == "push"


def test_the_proxy_signs_the_tokens_it_appends_and_nothing_else() -> None:
    """with_appended_tokens: the appended count is signed again with the same expiry; params that do not check
    are not signed (no signing oracle) and so are refused by the decode engine."""
    params = _signed(prompt_digest=prompt_digest(range(90)))
    appended = with_appended_tokens(params, 1, SECRET, now=NOW)
    remote = parse_remote_prefill(appended, secret=SECRET, now=NOW)
    assert remote.appended_tokens == 1 and remote.prompt_digest == prompt_digest(range(90))
    assert appended[CAPABILITY_KEY].split(".")[1] == params[CAPABILITY_KEY].split(".")[1]
    forged = with_appended_tokens({**params, "remote_port": 5601}, 1, SECRET, now=NOW)
    with pytest.raises(KVTransferParamsError, match=CAPABILITY_KEY):
        parse_remote_prefill(forged, secret=SECRET, now=NOW)
    assert with_appended_tokens(params, 2, None)["appended_tokens"] == 2  # insecure: nothing to sign


def test_the_load_checks_the_prompt_against_its_digest() -> None:
    """Params of a 90-token prompt: loaded into a prompt starting with those 90 tokens (any continuation the
    proxy appended), refused for any other prompt of the same length or with other content."""
    ids = list(range(1000, 1090))
    remote = parse_remote_prefill(with_appended_tokens(_signed(group_sizes=[], block_ids=[1, 2, 3],
                                                               prompt_digest=prompt_digest(ids)), 1, SECRET, now=NOW),
                                  secret=SECRET, now=NOW)
    assert DecodeLoad.of(remote, [*ids, 7], 0, 1).loaded_tokens == 90
    for other in ([*ids[:-1], 5, 7], [5, *ids[1:], 7], [*ids[::-1], 7]):
        with pytest.raises(KVTransferParamsError, match="remote_prompt_digest does not match"):
            DecodeLoad.of(remote, other, 0, 1)


@pytest.mark.parametrize("capability", [None, "", 7, "v2.1.2", "v1.abc." + "0" * 64, "v1.1." + "0" * 63,
                                        "v1." + "9" * 13 + "." + "0" * 64])
def test_missing_or_malformed_capabilities_are_refused(capability) -> None:
    params = {**_signed(), CAPABILITY_KEY: capability}
    if capability is None:
        del params[CAPABILITY_KEY]
    with pytest.raises(KVTransferParamsError, match=CAPABILITY_KEY):
        parse_remote_prefill(params, secret=SECRET, now=NOW)


def test_another_secret_and_expiry_are_refused() -> None:
    params = _signed()
    with pytest.raises(KVTransferParamsError, match="another secret"):
        parse_remote_prefill(params, secret=b"another-secret-of-enough-bytes!", now=NOW)
    parse_remote_prefill(params, secret=SECRET, now=NOW + 120 + CLOCK_SKEW_S)
    with pytest.raises(KVTransferParamsError, match="expired"):
        parse_remote_prefill(params, secret=SECRET, now=NOW + 121 + CLOCK_SKEW_S)


@pytest.mark.parametrize("ahead", [DEFAULT_MAX_LIFETIME_S + CLOCK_SKEW_S + 1, 86_400, 9_999_999_999 - NOW])
def test_a_capability_expiring_too_far_ahead_is_refused_naming_the_field(ahead: float) -> None:
    """A signer whose clock runs a day fast, or a forged far-future expiry: refused from the expiry alone, the
    message naming the field, how far ahead, the limit and the fix; no key but the capability is read."""
    params = {"remote_block_ids": Untouchable(range(8)),
              CAPABILITY_KEY: f"v1.{int(NOW + ahead)}.{'0' * 64}"}
    with pytest.raises(KVTransferParamsError) as info:
        parse_remote_prefill(params, secret=SECRET, now=NOW)
    message = str(info.value)
    assert message.startswith(f"kv_transfer_params.{CAPABILITY_KEY} expires {ahead:.0f} s from now, more than "
                              f"the {DEFAULT_MAX_LIFETIME_S:.0f} s this engine accepts")
    assert "clock" in message and "lease_s" in message
    with pytest.raises(KVTransferParamsError, match="more than the 40 s"):
        parse_remote_prefill(params, secret=SECRET, now=NOW, max_lifetime_s=40)


def test_a_capability_at_exactly_the_lifetime_limit_is_accepted() -> None:
    limit = 40 + CLOCK_SKEW_S
    params = sign_params(_signed(), SECRET, NOW + limit)
    assert parse_remote_prefill(params, secret=SECRET, now=NOW, max_lifetime_s=40).request_id == "cmpl-abc-0"
    with pytest.raises(KVTransferParamsError, match="expires 46 s from now"):
        parse_remote_prefill(params, secret=SECRET, now=NOW - 1, max_lifetime_s=40)
    check_capability(parse_remote_prefill(params, secret=None), params[CAPABILITY_KEY], SECRET, NOW,
                     max_lifetime_s=40)
    with pytest.raises(KVTransferParamsError, match=f"{CAPABILITY_KEY} expires 46 s from now"):
        check_capability(parse_remote_prefill(params, secret=None), params[CAPABILITY_KEY], SECRET, NOW - 1,
                         max_lifetime_s=40)
    assert with_appended_tokens(params, 1, SECRET, now=NOW, max_lifetime_s=40)[CAPABILITY_KEY] != \
        params[CAPABILITY_KEY]  # signed again
    unsigned_again = with_appended_tokens(params, 1, SECRET, now=NOW - 1, max_lifetime_s=40)
    assert unsigned_again[CAPABILITY_KEY] == params[CAPABILITY_KEY]  # too far ahead: not signed again


def test_insecure_deployments_accept_unsigned_params() -> None:
    params = {k: v for k, v in _signed().items() if k != CAPABILITY_KEY}
    assert parse_remote_prefill(params, secret=None).request_id == "cmpl-abc-0"


@pytest.mark.parametrize(("key", "value"), [
    ("remote_request_id", "x\ud800"),
    ("remote_request_id", "a|b"),
    ("remote_request_id", "r" * 257),
    ("remote_request_id", "line\nbreak"),
    ("remote_engine_id", "é"),
    ("remote_host", "host name"),
    ("remote_host", "h" * 254),
])
def test_ids_and_hosts_are_bounded_before_the_mac(key, value) -> None:
    """A lone surrogate once stopped a decode worker (its "done" could not be encoded)."""
    with pytest.raises(KVTransferParamsError, match=key):
        parse_remote_prefill({**_signed(), key: value}, secret=SECRET, now=NOW)


@pytest.mark.parametrize("value", [[[MAX_BLOCK_ID + 1]], [[2**63]], [2**64, 1], [[-1, 2]], [[True]], [[1.0]]])
def test_block_ids_are_bounded_after_the_mac_and_without_a_secret(value) -> None:
    """A block id past 2**63 once left pulls in HANDSHAKE for ever (OverflowError while planning). Under the
    secret such ids are refused (the MAC does not cover them, or they cannot be encoded as block ids could);
    without one, by their own check, naming the key."""
    with pytest.raises(KVTransferParamsError, match=f"{CAPABILITY_KEY}|remote_block_ids"):
        parse_remote_prefill({**_signed(), "remote_block_ids": value}, secret=SECRET, now=NOW)
    unsigned = {k: v for k, v in _signed().items() if k != CAPABILITY_KEY}
    with pytest.raises(KVTransferParamsError, match=r"remote_block_ids(\[0\])? holds"):
        parse_remote_prefill({**unsigned, "remote_block_ids": value}, secret=None)


class Untouchable(list):
    """A block id list that fails the test if its ids are gone through (its length and first item, which tells
    one list from per-group lists, may be read)."""

    def __iter__(self):
        raise AssertionError("the block ids were gone through before the cheap refusals")


def test_unsigned_params_are_refused_before_any_block_id_is_read() -> None:
    """Unsigned, or expired: refused from the capability's form and time alone (no block id, no MAC)."""
    huge = Untouchable(range(1 << 20))
    unsigned = {**_signed(), "remote_block_ids": huge}
    del unsigned[CAPABILITY_KEY]
    with pytest.raises(KVTransferParamsError, match=f"{CAPABILITY_KEY} is missing"):
        parse_remote_prefill(unsigned, secret=SECRET, now=NOW)
    expired = {**_signed(expiry_time=NOW - 100), "remote_block_ids": huge}
    expired[CAPABILITY_KEY] = f"v1.{int(NOW) - 100}.{'0' * 64}"
    with pytest.raises(KVTransferParamsError, match="expired"):
        parse_remote_prefill(expired, secret=SECRET, now=NOW)


def test_block_lists_longer_than_the_engine_takes_are_refused_by_their_length() -> None:
    """A signed-looking capability with more block ids than the decode engine's longest prompt: refused from the
    list's length, before any id is looked at; a list the engine takes parses."""
    params = _signed(block_ids=list(range(8)), group_sizes=[])
    parse_remote_prefill(params, secret=SECRET, now=NOW, max_blocks=8)
    with pytest.raises(KVTransferParamsError, match="at most 7 block ids \\(got 8\\)"):
        parse_remote_prefill({**params, "remote_block_ids": Untouchable(range(8))}, secret=SECRET, now=NOW,
                             max_blocks=7)
    with pytest.raises(KVTransferParamsError, match=r"remote_block_ids\[1\] must be a list of at most 2"):
        parse_remote_prefill({**params, "remote_block_ids": [[1], Untouchable(range(3))]}, secret=SECRET, now=NOW,
                             max_blocks=2)


def test_a_pipeline_parallel_answer_names_its_stages_and_bounds_every_stage_port() -> None:
    """``pp_size`` is made, signed and parsed; a pp_size past :data:`MAX_PP_SIZE`, below 1, or one whose last
    worker's port (``port + tp_size * pp_size - 1``) is no TCP port is refused naming the key."""
    params = make_prefill_response_params(engine_id="prefill-0", request_id="r", host="127.0.0.1", port=5600,
                                          block_ids=[1, 2], tp_size=2, pp_size=4, num_tokens=20,
                                          expiry_time=NOW + 60, secret=SECRET)
    remote = parse_remote_prefill(params, secret=SECRET, now=NOW)
    assert (params["pp_size"], remote.pp_size, remote.num_ranks) == (4, 4, 8)
    assert parse_remote_prefill(_signed(), secret=SECRET, now=NOW).pp_size == 1
    for value in (0, MAX_PP_SIZE + 1, "2"):
        with pytest.raises(KVTransferParamsError, match=r"kv_transfer_params\.pp_size"):
            parse_remote_prefill({**params, "pp_size": value}, secret=None)
    with pytest.raises(KVTransferParamsError, match=r"remote_port=65530.*tp_size 2 and pp_size 4"):
        parse_remote_prefill({**params, "remote_port": 65530}, secret=None)


@pytest.mark.parametrize("key", ["tp_size", "appended_tokens", "remote_num_tokens", "remote_block_ids",
                                 "p2pkv_transfer_mode"])
def test_a_refused_value_is_never_shown_whole(key: str) -> None:
    """An 8 MiB value (an int of ~20 million digits, or a list of a million ids) in an error, so in a log line,
    is described by its size."""
    huge = 1 << (8 * 8 * 1024 * 1024)
    value = [[huge]] if key == "remote_block_ids" else huge
    with pytest.raises(KVTransferParamsError) as info:
        parse_remote_prefill({**_signed(), key: value}, secret=SECRET, now=NOW)
    assert len(str(info.value)) < 400
    if key == "remote_block_ids":  # under the secret refused before its ids are looked at: shown not at all
        assert "remote_block_ids holds a value that is no block id" in str(info.value)
        with pytest.raises(KVTransferParamsError) as info:
            parse_remote_prefill({**_signed(), key: value, CAPABILITY_KEY: None}, secret=None)
    assert len(str(info.value)) < 400 and f"<int of {huge.bit_length()} bits>" in str(info.value)
    with pytest.raises(KVTransferParamsError) as info:
        parse_remote_prefill({**_signed(), "tp_size": list(range(1 << 20))}, secret=SECRET, now=NOW)
    assert len(str(info.value)) < 400 and "<list of 1048576 items>" in str(info.value)


@pytest.mark.parametrize("kw", [
    {},
    {"group_sizes": [], "block_ids": [5, 6, 7], "tp_size": 1},
    {"group_sizes": [2, 0, 1], "block_ids": [1, 2, 3], "prompt_digest": "ab" * 16},
    {"group_sizes": [3], "block_ids": [8, 9, 10], "num_tokens": 0, "expiry_time": NOW + 0.25},
])
def test_params_signed_as_they_are_made_equal_params_signed_afterwards(kw: dict) -> None:
    """The prefill scheduler signs while it builds its answer (no parsing back): the same capability as
    sign_params gives, which the decode engine accepts."""
    args: dict = {"engine_id": "prefill-0", "request_id": "cmpl-abc-0", "host": "127.0.0.1", "port": 5600,
                  "block_ids": [3, 4, 9, 0, 0, 7], "group_sizes": [3, 3], "tp_size": 2, "num_tokens": 90,
                  "expiry_time": NOW + 120, **kw}
    made = make_prefill_response_params(**args, secret=SECRET)
    assert made == sign_params(make_prefill_response_params(**args), SECRET, args["expiry_time"])
    assert parse_remote_prefill(made, secret=SECRET, now=NOW).block_ids == tuple(args["block_ids"])
    with pytest.raises(ValueError, match="expiry_time"):
        make_prefill_response_params(**{**args, "expiry_time": None}, secret=SECRET)


def test_the_prompt_digest_is_sha256_of_little_endian_int64s() -> None:
    ids = [0, 1, 151_000, 2**62, 7]
    assert prompt_digest(ids) == hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()[:32]
    assert prompt_digest(range(3)) == prompt_digest([0, 1, 2]) and prompt_digest([]) == hashlib.sha256(
        b"").hexdigest()[:32]
    with pytest.raises(OverflowError, match="int64"):
        prompt_digest([1, 2**63])
