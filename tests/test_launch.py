"""The launcher fails fast, naming the flag, before starting anything."""

from __future__ import annotations

import json
import socket

import pytest

from p2pkv.cli import main
from p2pkv.deploy.engines import EngineSpec
from p2pkv.deploy.local import LocalPair
from p2pkv.deploy.processes import LaunchError
from tests.conftest import free_ports


def test_missing_model_dir_names_the_flag(tmp_path, capsys) -> None:
    assert main(["launch", "local", "--model", str(tmp_path / "nope")]) == 1
    assert "--model" in capsys.readouterr().err


def test_port_in_use_names_the_flag(tmp_path) -> None:
    (busy,) = free_ports(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        pair = LocalPair(model=str(tmp_path), decode_port=busy)
        with pytest.raises(LaunchError, match="--decode-port"):
            pair.check()


def test_ports_must_differ(tmp_path) -> None:
    with pytest.raises(LaunchError, match="ports must differ"):
        LocalPair(model=str(tmp_path), prefill_port=9000, decode_port=9000).check()


def test_engine_commands_carry_the_connector_config(tmp_path) -> None:
    pair = LocalPair(model=str(tmp_path), side_channel_port=6000, aggregated_port=9999)
    prefill, decode, agg = pair.engine_specs()
    ktc = json.loads(prefill.command()[prefill.command().index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "P2pKvConnector" and ktc["kv_connector_module_path"] == "p2pkv.connector"
    assert ktc["kv_connector_extra_config"]["side_channel_port"] == 6000
    dktc = json.loads(decode.command()[decode.command().index("--kv-transfer-config") + 1])
    assert dktc["kv_connector_extra_config"]["side_channel_port"] == 6100
    assert "--kv-transfer-config" not in agg.command()
    nixl = EngineSpec(name="p", model="m", port=1, role="prefill", connector="nixl")
    assert json.loads(nixl.command()[nixl.command().index("--kv-transfer-config") + 1])["kv_connector"] == \
        "NixlConnector"
