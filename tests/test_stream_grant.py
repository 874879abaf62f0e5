"""The stream grant (:mod:`p2pkv.grant`): made by the proxy, checked by both engines, refused when anything differs."""

from __future__ import annotations

import time

import pytest

from p2pkv.grant import (
    ANY_DECODE,
    GRANT_KEY,
    GRANT_LIFETIME_S,
    StreamGrant,
    StreamGrantError,
    check_stream_grant,
    make_stream_grant,
    parse_stream_leg,
)
from p2pkv.params import CLOCK_SKEW_S, DEFAULT_MAX_LIFETIME_S, KVTransferParamsError
from p2pkv.tools.proxy.stream import PrefillAddress, StreamLegs

KEY = b"stream-grant-test-secret"
SID = "0123456789abcdef0123456789abcdef"
NOW = 1_800_000_000.0
ENGINES = {"prefill_engine_id": "prefill-a", "decode_engine_id": "decode-b"}


def _grant(**kw: object) -> str:
    args = {**ENGINES, "secret": KEY, "expiry": NOW + 30.2, "stream_id": SID, **kw}
    return make_stream_grant(**args)  # type: ignore[arg-type]


def test_a_grant_checks_for_its_two_engines_until_it_expires() -> None:
    grant = _grant()
    assert grant.startswith(f"v2.{SID}.{int(NOW) + 31}.")
    assert check_stream_grant(grant, KEY, now=NOW, **ENGINES) == StreamGrant(SID, int(NOW) + 31)
    assert check_stream_grant(grant, KEY, now=NOW + 31 + CLOCK_SKEW_S, **ENGINES).stream_id == SID
    with pytest.raises(StreamGrantError, match=f"kv_transfer_params.{GRANT_KEY} expired 6 s ago"):
        check_stream_grant(grant, KEY, now=NOW + 31 + CLOCK_SKEW_S + 1, **ENGINES)
    a, b = make_stream_grant("p", "d", KEY, NOW), make_stream_grant("p", "d", KEY, NOW)
    assert a.split(".")[1] != b.split(".")[1], "stream ids are drawn at random"


@pytest.mark.parametrize(("why", "engines", "secret"), [
    ("another prefill engine", {"prefill_engine_id": "prefill-c", "decode_engine_id": "decode-b"}, KEY),
    ("another decode engine", {"prefill_engine_id": "prefill-a", "decode_engine_id": "decode-c"}, KEY),
    ("the engines swapped", {"prefill_engine_id": "decode-b", "decode_engine_id": "prefill-a"}, KEY),
    ("another secret", ENGINES, b"another secret"),
])
def test_a_grant_for_other_engines_or_another_secret_is_refused(why: str, engines: dict[str, str],
                                                                 secret: bytes) -> None:
    with pytest.raises(StreamGrantError, match="does not cover a stream"):
        check_stream_grant(_grant(), secret, now=NOW, **engines)


def test_a_grant_altered_anywhere_is_refused() -> None:
    version, sid, expiry, mac = _grant().split(".")
    flip = {"0": "1"}
    altered = [f"{version}.{'f' + sid[1:]}.{expiry}.{mac}",  # another stream
               f"{version}.{sid}.{int(expiry) + 100}.{mac}",  # a later expiry
               f"{version}.{sid}.{expiry}.{flip.get(mac[0], '0') + mac[1:]}"]
    for grant in altered:
        with pytest.raises(StreamGrantError, match="does not cover"):
            check_stream_grant(grant, KEY, now=NOW, **ENGINES)


@pytest.mark.parametrize("grant", [None, 7, "", "v3" + _grant()[2:], _grant() + "0", _grant().upper(),
                                   _grant().replace(".", ":"), f"v2.{SID}.1234567890123.{'0' * 64}",
                                   ["v2", SID], {"grant": _grant()}, "v2." + "0" * 1_000_000])
def test_a_malformed_grant_is_refused_before_anything_is_read(grant: object) -> None:
    with pytest.raises(StreamGrantError, match=f"kv_transfer_params.{GRANT_KEY}=.* is malformed") as info:
        check_stream_grant(grant, KEY, now=NOW, **ENGINES)
    assert isinstance(info.value, KVTransferParamsError)  # the engines' answer to bad params: a clear 400
    assert len(str(info.value)) < 400  # a huge value is not echoed whole


def test_a_v1_grant_from_an_older_proxy_is_refused_naming_the_upgrade() -> None:
    """A v1 grant's MAC named no pipeline stages: refused before its MAC is read, naming the fix."""
    with pytest.raises(StreamGrantError, match=r"is a v1 grant, from a proxy older than this engine.*upgrade the "
                                               r"proxy"):
        check_stream_grant(f"v1.{SID}.{int(NOW) + 30}.{'0' * 64}", KEY, now=NOW, **ENGINES)


def test_a_grant_names_the_prefill_engines_stages() -> None:
    """The MAC covers the prefill engine's ``pp_size``: a grant made for 2 stages checks for 2 only, so a prefill
    engine running another number of stages (restarted so) refuses it, and a decode leg that names other stages
    than the proxy signed is refused, naming ``pp_size``, before anything moves."""
    grant = _grant(pp_size=2)
    assert check_stream_grant(grant, KEY, now=NOW, pp_size=2, **ENGINES).stream_id == SID
    for pp_size in (1, 3):
        with pytest.raises(StreamGrantError, match=rf"\(pp_size {pp_size}\).*another pp_size"):
            check_stream_grant(grant, KEY, now=NOW, pp_size=pp_size, **ENGINES)
    with pytest.raises(StreamGrantError, match=r"\(pp_size 2\)"):
        check_stream_grant(_grant(), KEY, now=NOW, pp_size=2, **ENGINES)
    leg = {"remote_engine_id": "prefill-a", "remote_host": "127.0.0.1", "remote_port": 5600, GRANT_KEY: grant}
    with pytest.raises(StreamGrantError, match=r"\(pp_size 1\)"):
        parse_stream_leg(leg, KEY, decode_engine_id="decode-b", now=NOW)  # no pp_size: one stage
    assert parse_stream_leg({**leg, "pp_size": 2}, KEY, decode_engine_id="decode-b", now=NOW)[0].pp_size == 2
    with pytest.raises(ValueError, match="pp_size must be >= 1"):
        make_stream_grant("p", "d", KEY, NOW, pp_size=0)


def test_making_a_grant_needs_a_secret_both_engines_and_a_well_formed_stream_id() -> None:
    with pytest.raises(ValueError, match="needs the secret"):
        make_stream_grant("p", "d", b"", NOW)
    with pytest.raises(ValueError, match="needs the secret"):
        make_stream_grant("", "d", KEY, NOW)
    with pytest.raises(ValueError, match="32 hex digits"):
        make_stream_grant("p", "d", KEY, NOW, stream_id="xyz")


@pytest.mark.parametrize("ahead", [DEFAULT_MAX_LIFETIME_S + CLOCK_SKEW_S + 1, 86_400, 9_999_999_999 - NOW])
def test_a_grant_expiring_too_far_ahead_is_refused_naming_the_field(ahead: float) -> None:
    """A proxy whose clock runs a day fast would make the engines remember its stream ids for a day: refused
    before the MAC, naming the field, how far ahead, the limit and the fix."""
    grant = f"v2.{SID}.{int(NOW + ahead)}.{'0' * 64}"
    with pytest.raises(StreamGrantError) as info:
        check_stream_grant(grant, KEY, now=NOW, **ENGINES)
    message = str(info.value)
    assert message.startswith(f"kv_transfer_params.{GRANT_KEY} expires {ahead:.0f} s from now, more than the "
                              f"{DEFAULT_MAX_LIFETIME_S:.0f} s this engine accepts")
    assert "clock" in message and "lease_s" in message and f"{GRANT_LIFETIME_S:.0f} s" in message


def test_a_grant_at_exactly_the_lifetime_limit_is_accepted() -> None:
    grant = _grant(expiry=NOW + 40 + CLOCK_SKEW_S)
    assert check_stream_grant(grant, KEY, now=NOW, max_lifetime_s=40, **ENGINES).stream_id == SID
    with pytest.raises(StreamGrantError, match="expires 46 s from now, more than the 40 s"):
        check_stream_grant(grant, KEY, now=NOW - 1, max_lifetime_s=40, **ENGINES)
    params = {"remote_engine_id": "prefill-a", "remote_host": "127.0.0.1", "remote_port": 5600, GRANT_KEY: grant}
    remote, _ = parse_stream_leg(params, KEY, decode_engine_id="decode-b", now=NOW, max_lifetime_s=40)
    assert remote.request_id == SID
    with pytest.raises(StreamGrantError, match="expires 46 s from now"):
        parse_stream_leg(params, KEY, decode_engine_id="decode-b", now=NOW - 1, max_lifetime_s=40)


@pytest.mark.parametrize(("grant_s", "lifetime"), [(3600.0, GRANT_LIFETIME_S), (30.0, 30.0)])
def test_the_proxy_signs_grants_for_at_most_the_grant_lifetime(grant_s: float, lifetime: float) -> None:
    """The proxy's request timeout (its grant_s) may be an hour; its grants last at most GRANT_LIFETIME_S, which
    every engine with the default lease_s accepts."""
    legs = StreamLegs(KEY, grant_s)
    legs.addresses["http://prefill"] = PrefillAddress("prefill-a", "127.0.0.1", 5600, 1)
    before = time.time()
    made = legs.legs("http://prefill", {"prompt": "hi", "max_tokens": 3})
    assert made is not None
    expiry = int(made[1][GRANT_KEY].split(".")[2])
    assert before + lifetime <= expiry <= time.time() + lifetime + 1
    assert GRANT_LIFETIME_S <= DEFAULT_MAX_LIFETIME_S
    assert check_stream_grant(made[1][GRANT_KEY], KEY, prefill_engine_id="prefill-a",
                              decode_engine_id=ANY_DECODE, now=before).expiry == expiry


def test_a_stream_leg_names_the_prefill_engines_stages_and_bounds_their_ports() -> None:
    """A PP prefill engine's decode leg names its ``pp_size``: the load streams from every stage's workers (ranks
    ``0 .. tp_size * pp_size - 1``, each port ``remote_port + rank`` a TCP port)."""
    params = {"remote_engine_id": "prefill-a", "remote_host": "127.0.0.1", "remote_port": 5600, "pp_size": 2,
              "tp_size": 2, GRANT_KEY: _grant(pp_size=2)}
    remote, _ = parse_stream_leg(params, KEY, decode_engine_id="decode-b", now=NOW)
    assert (remote.pp_size, remote.num_ranks) == (2, 4)
    with pytest.raises(KVTransferParamsError, match=r"remote_port=65533.*pp_size 2"):
        parse_stream_leg({**params, "remote_port": 65533}, KEY, decode_engine_id="decode-b", now=NOW)
