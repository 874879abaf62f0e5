"""Config and kv_transfer_params: bad input gets an error that names the field."""

from __future__ import annotations

import pytest

from p2pkv.config import REMOVED, ConfigError, P2pKvConfig, load_config
from p2pkv.params import (
    KVTransferParamsError,
    make_prefill_response_params,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)


def test_config_defaults_env_and_extra_config() -> None:
    cfg = load_config(None, environ={})
    assert cfg.side_channel_port == 5600 and cfg.kv_layout == "BLHNC" and cfg.transfer_cpus == ""
    cfg = load_config({"lease_s": 5}, environ={"P2PKV_LEASE_S": "9", "P2PKV_NIXL_BACKENDS": "UCX, GDS"})
    assert cfg.lease_s == 5.0 and cfg.nixl_backends == ["UCX", "GDS"]


@pytest.mark.parametrize(("extra", "field"), [
    ({"lease": 5}, "lease"),
    ({"side_channel_port": 70000}, "side_channel_port"),
    ({"side_channel_port": "abc"}, "side_channel_port"),
    ({"lease_s": 0}, "lease_s"),
    ({"kv_layout": "XYZ"}, "kv_layout"),
    ({"stream_min_tokens": -2}, "stream_min_tokens"),
    ({"stream_min_tokens": 1.5}, "stream_min_tokens"),
    ({"transfer_cpus": "1-0"}, "transfer_cpus"),
    ({"transfer_cpus": "two"}, "transfer_cpus"),
])
def test_config_errors_name_the_field(extra, field) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(extra, environ={})


def test_secret_comes_from_the_environment_or_a_file_never_the_extra_config(tmp_path) -> None:
    """vLLM prints kv_connector_extra_config in its log (non-default args) and it is on the engine's command
    line: a secret there is refused, naming the fix; P2PKV_SECRET and secret_file work."""
    key = "0123456789abcdef-side-channel"
    with pytest.raises(ConfigError, match="secret in kv_connector_extra_config") as info:
        load_config({"secret": key}, environ={})
    assert "P2PKV_SECRET" in str(info.value) and "secret_file=PATH" in str(info.value) and key not in str(info.value)
    assert load_config({"secret": ""}, environ={}).secret_bytes() is None
    assert load_config(None, environ={"P2PKV_SECRET": f" {key}\n"}).require_secret() == key.encode()
    path = tmp_path / "secret"
    path.write_text(key + "\n")
    assert load_config({"secret_file": str(path)}, environ={}).require_secret() == key.encode()


def test_a_workers_pulls_use_the_key_it_loaded_and_never_read_the_secret_file_again(tmp_path) -> None:
    """The secret file is read once, when the worker starts: its pulls (fence, handshakes, notifications,
    pushes) sign with that key even after the file changed or went away. Before: the receiver read the file
    again when the KV caches were registered, failing on a file gone, or signing with another key."""
    from p2pkv.testing import make_kv_caches
    from tests.workers import NUM_BLOCKS, SHAPE, free_port, make_worker

    key = "0123456789abcdef-side-channel"
    path = tmp_path / "secret"
    path.write_text(key + "\n")
    worker = make_worker("decode-engine", free_port(), secret_file=str(path), insecure=False)
    try:
        path.unlink()  # a rotated Kubernetes secret is swapped under the running engine
        _, views = make_kv_caches("BLHNC", seed=1, **SHAPE)
        worker.register_kv_caches(views, NUM_BLOCKS)
        receiver = worker.receiver
        assert receiver is not None
        users = (receiver.fence, receiver.keeper, receiver.notifier, receiver.pushes)
        assert all(user.secret == key.encode() for user in users)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("where", ["env", "file"])
def test_a_short_secret_is_refused_naming_the_minimum_and_how_to_make_one(tmp_path, where: str) -> None:
    short = "  0123456789abcde \n"  # 15 bytes once stripped
    path = tmp_path / "secret"
    path.write_text(short)
    cfg = load_config({"secret_file": str(path)}, environ={}) if where == "file" else \
        load_config(None, environ={"P2PKV_SECRET": short})
    with pytest.raises(ConfigError, match="minimum 16") as info:
        cfg.require_secret()
    assert "secrets.token_hex(32)" in str(info.value)
    assert (str(path) if where == "file" else "P2PKV_SECRET") in str(info.value)


def test_params_round_trip_nixl_compatible() -> None:
    out = make_prefill_response_params(engine_id="e1", request_id="r1", host="10.0.0.2", port=5600,
                                       block_ids=[4, 5, 9], tp_size=1, num_tokens=70, expiry_time=None)
    for key in ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
                "remote_host", "remote_port", "remote_request_id", "tp_size"):
        assert key in out
    assert out["remote_block_ids"] == [[4, 5, 9]]  # a list per KV cache group, as NixlConnector sends
    assert wants_remote_prefill(out) and not wants_remote_decode(out)
    rp = parse_remote_prefill(out, secret=None)
    assert rp.block_ids == (4, 5, 9) and rp.port == 5600 and rp.num_tokens == 70
    assert parse_remote_prefill({**out, "remote_block_ids": [1, 2]}, secret=None).block_ids == (1, 2)


def test_params_carry_every_kv_cache_group() -> None:
    """HMA: one list per KV cache group out, the groups back in order (a window group's nulls kept)."""
    out = make_prefill_response_params(engine_id="e1", request_id="r1", host="h", port=5600,
                                       block_ids=[4, 5, 9, 0, 0, 7], group_sizes=[3, 3], tp_size=1,
                                       num_tokens=40, expiry_time=None)
    assert out["remote_block_ids"] == [[4, 5, 9], [0, 0, 7]]
    rp = parse_remote_prefill(out, secret=None)
    assert rp.block_ids == (4, 5, 9, 0, 0, 7) and rp.group_sizes == (3, 3)
    assert rp.groups() == ((4, 5, 9), (0, 0, 7))
    one = parse_remote_prefill({**out, "remote_block_ids": [[4, 5]]}, secret=None)
    assert one.group_sizes == () and one.groups() == ((4, 5),)


@pytest.mark.parametrize(("change", "field"), [
    ({"remote_port": None}, "remote_port"),
    ({"remote_port": "5600"}, "remote_port"),
    ({"remote_port": 0}, "remote_port"),
    ({"remote_engine_id": 3}, "remote_engine_id"),
    ({"remote_block_ids": [[1], 2]}, "remote_block_ids"),
    ({"remote_block_ids": [[1]] * 65}, "remote_block_ids"),
    ({"remote_block_ids": [[1], [-2]]}, r"remote_block_ids\[1\]"),
    ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
    ({"remote_block_ids": "1,2"}, "remote_block_ids"),
    ({"remote_block_ids": [1, True]}, "remote_block_ids"),
    ({"remote_block_ids": [1.0, 2]}, "remote_block_ids"),
    ({"remote_block_ids": [[1, -1]]}, "remote_block_ids"),
    ({"remote_block_ids": [list(range(2_000_001))]}, "remote_block_ids"),
    ({"remote_host": None}, "remote_host"),
])
def test_bad_params_name_the_key(change, field) -> None:
    good = make_prefill_response_params(engine_id="e1", request_id="r1", host="h", port=5600,
                                        block_ids=[1], tp_size=1, num_tokens=1, expiry_time=None)
    with pytest.raises(KVTransferParamsError, match=field):
        parse_remote_prefill({**good, **change}, secret=None)


MOST_SETTINGS = 22
"""The seam's handful (20), ``verify_kv`` (verified KV's switch) and ``keep_turns_s`` (multi-turn reuse's: how long
a decode engine keeps a conversation's blocks), which an operator must see."""


def test_a_handful_of_settings() -> None:
    """At most :data:`MOST_SETTINGS` settings, and none of them a removed one."""
    fields = set(P2pKvConfig.__struct_fields__)
    assert len(fields) <= MOST_SETTINGS, sorted(fields)
    assert fields.isdisjoint(REMOVED), fields & set(REMOVED)


@pytest.mark.parametrize("key", sorted(REMOVED))
def test_a_removed_setting_is_refused_naming_its_replacement(key: str) -> None:
    """Given in kv_connector_extra_config or as P2PKV_<KEY> (whatever its value), a removed setting stops the
    engine with an error naming it and what replaced it; other settings beside it change nothing."""
    with pytest.raises(ConfigError) as info:
        load_config({"lease_s": 30, key: 1}, environ={})
    message = str(info.value)
    assert f"`{key}` was removed: {REMOVED[key]}" in message and "remove the key" in message
    variable = f"P2PKV_{key.upper()}"
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={variable: "1", "P2PKV_LEASE_S": "30"})
    assert f"`{key}` was removed: {REMOVED[key]}" in str(info.value) and f"unset {variable}" in str(info.value)


def test_removed_settings_name_a_replacement_that_exists() -> None:
    """Each constant a removal names (``module.NAME``) is there, so the message sends users somewhere real."""
    import importlib
    import re

    for key, replacement in REMOVED.items():
        for dotted in re.findall(r"\b((?:p2pkv|handshake)(?:\.[a-z_]+)+)\.([A-Z_]+)\b", replacement):
            module, name = dotted
            assert hasattr(importlib.import_module(module), name), f"{key}: {module}.{name} does not exist"


def test_connector_stats_aggregate_and_reduce() -> None:
    from p2pkv.telemetry.metrics import P2pKvStats

    a = P2pKvStats(data={"pull_bytes": [100], "pull_seconds": [0.5], "pull_descriptors": [2],
                         "handshake_seconds": [], "leases_expired": 1, "leases_notified": 0,
                         "failures": {"timeout": 1}})
    b = P2pKvStats(data={"pull_bytes": [300], "pull_seconds": [1.5], "pull_descriptors": [4],
                         "handshake_seconds": [0.01], "leases_expired": 0, "leases_notified": 2,
                         "failures": {"timeout": 2, "handshake": 1}})
    assert P2pKvStats().is_empty() and not a.is_empty()
    agg = a.aggregate(b)
    assert agg.data["pull_bytes"] == [100, 300] and agg.data["failures"] == {"timeout": 3, "handshake": 1}
    assert agg.data["push_requests"] == {} and agg.data["push_bytes"] == 0  # counts absent from both: none
    pushed = P2pKvStats(data={"push_requests": {"accepted": 2, "busy": 1}, "push_writes": {"written": 2},
                              "push_bytes": 8192})
    agg = agg.aggregate(pushed).aggregate(P2pKvStats(data={"push_requests": {"accepted": 1},
                                                          "push_writes": {"failed": 1}, "push_bytes": 0}))
    assert agg.data["push_requests"] == {"accepted": 3, "busy": 1}
    assert agg.data["push_writes"] == {"written": 2, "failed": 1} and agg.data["push_bytes"] == 8192
    red = agg.reduce()
    assert red["pulls"] == 2 and red["failures"] == 4 and red["leases_expired"] == 1
    assert red["GB_per_s"] == round(400 / 2.0 / 1e9, 3) and red["avg_pull_ms"] == 1000.0
