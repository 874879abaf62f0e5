"""The compatibility check: whatever would corrupt output refuses the peer at handshake, naming both values.

Fields come from real vLLM configs of the tiny models (one engine's config
differs from the other's in one setting); the refusal comes from the real
side-channel client against a real server.
"""

from __future__ import annotations

import pytest

from handshake import Destination, HandshakeServer, IncompatiblePeerError, fetch_agent_info
from handshake.fingerprints import OPAQUE, describe, fingerprint, mismatches
from p2pkv.tools.tiny_model import TinyModelSpec, make_tiny_model
from tests.handshake_support import make_agent_info


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory):
    """``build(**engine_args)`` → a real ``VllmConfig`` of the tiny Llama.

    ``kind=``, ``layers=`` and ``kv_heads=`` pick another tiny model.
    """
    from vllm.engine.arg_utils import EngineArgs

    root = tmp_path_factory.mktemp("compat-models")

    def build(kind: str = "llama", layers: int = 4, kv_heads: int = 2, **engine_args):
        spec = TinyModelSpec(kind=kind, num_layers=layers, num_kv_heads=kv_heads)
        model = make_tiny_model(root / f"{kind}-{layers}-{kv_heads}", spec)
        args = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, **engine_args}
        return EngineArgs(model=str(model), **args).create_engine_config()

    return build


def _groups(sliding_window: int | None, layers: int = 4):
    """A real vLLM ``KVCacheConfig``: one group of full or sliding-window attention layers."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    common = dict(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    spec = FullAttentionSpec(**common) if sliding_window is None else SlidingWindowSpec(
        **common, sliding_window=sliding_window)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def _refusal(mine: str, theirs: str) -> IncompatiblePeerError:
    """What the decode side (``mine``) raises when it handshakes with a prefill rank serving ``theirs``."""
    server = HandshakeServer("127.0.0.1", 0, theirs)
    server.set_info(make_agent_info(0, compat_hash=theirs))
    with server, pytest.raises(IncompatiblePeerError) as info:
        fetch_agent_info(Destination("127.0.0.1", server.port, "prefill-engine", 0), "decode", mine, timeout_s=5.0,
                         retries=1)
    return info.value


# Each case: the field that must differ, and (decode engine, prefill engine) as build() arguments.
CASES = {
    "vllm": ("vllm", {}, {"vllm_version": "0.33.1"}),
    "architecture": ("architecture", {}, {"kind": "sliding-window"}),
    "num_layers": ("num_layers", {}, {"layers": 2}),
    "kv_heads": ("total_num_kv_heads", {}, {"kv_heads": 4}),
    "head_size": ("head_size", {}, {"kind": "mla"}),
    "mla": ("mla", {}, {"kind": "mla"}),
    "model_dtype": ("model_dtype", {}, {"dtype": "bfloat16"}),
    "kv_cache_dtype": ("kv_cache_dtype", {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e5m2"}),
    "kv_cache_groups": ("kv_cache_groups", {"groups": None}, {"groups": 40}),
    "speculative": ("speculative", {}, {"speculative_config": "draft_model"}),
}


def _fields(configs, monkeypatch, args: dict) -> dict[str, str]:
    import vllm

    from p2pkv.engine_facts import compat_fields

    args = dict(args)
    monkeypatch.setattr(vllm, "__version__", args.pop("vllm_version", "0.32.0"))
    groups = _groups(args.pop("groups")) if "groups" in args else _groups(None)
    if args.get("speculative_config") == "draft_model":
        draft = configs().model_config.model
        args["speculative_config"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    return compat_fields(configs(**args), groups)


@pytest.mark.parametrize("case", list(CASES))
def test_each_mismatch_is_refused_naming_the_field_and_both_values(configs, monkeypatch, case) -> None:
    field, decode_args, prefill_args = CASES[case]
    decode, prefill = _fields(configs, monkeypatch, decode_args), _fields(configs, monkeypatch, prefill_args)
    assert decode[field] != prefill[field]
    err = _refusal(fingerprint(decode), fingerprint(prefill))
    assert err.code == "incompatible"
    assert err.field.startswith("info.compat_hash.")
    assert f"{field}: the peer has {prefill[field]!r}, this side has {decode[field]!r}" in str(err)


def test_what_is_negotiated_or_irrelevant_does_not_change_the_fields(configs, monkeypatch) -> None:
    """Block size, TP-independent settings, ngram speculation (no drafter KV), a vLLM patch release and the
    ``fp8`` alias of ``fp8_e4m3`` leave the fingerprint as it is."""
    base = _fields(configs, monkeypatch, {"kv_cache_dtype": "fp8_e4m3"})
    same = [
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype": "fp8_e4m3", "block_size": 64},
        {"kv_cache_dtype": "fp8_e4m3", "vllm_version": "0.32.7"},
        {"kv_cache_dtype": "fp8_e4m3", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                              "prompt_lookup_max": 3}},
    ]
    for args in same:
        assert mismatches(fingerprint(base), fingerprint(_fields(configs, monkeypatch, args))) == [], args


def test_mla_model_reports_its_latent_cache(configs, monkeypatch) -> None:
    fields = _fields(configs, monkeypatch, {"kind": "mla"})
    assert (fields["mla"], fields["head_size"], fields["architecture"]) == ("True", "576", "DeepseekV2ForCausalLM")


def test_mismatches_compares_field_by_field() -> None:
    a = fingerprint({"vllm": "0.32", "kv_cache_dtype": "auto", "num_layers": 4})
    b = fingerprint({"vllm": "0.33", "kv_cache_dtype": "auto", "num_layers": 4, "mla": True})
    assert mismatches(a, a) == []
    assert mismatches(a, b) == [("mla", "<absent>", "True"), ("vllm", "0.32", "0.33")]
    assert mismatches("opaque-1", a) == [(OPAQUE, "opaque-1", a)]
    assert describe(mismatches(a, b)[1:], "decode", "prefill") == "vllm: prefill has '0.33', decode has '0.32'"


def test_server_serves_a_mismatched_requester_and_logs_why(caplog) -> None:
    """The server publishes its fingerprint (only to holders of the secret when it has one) and says in its own log
    which fields differ; the requester refuses."""
    mine, theirs = fingerprint({"kv_cache_dtype": "auto"}), fingerprint({"kv_cache_dtype": "fp8_e5m2"})
    err = _refusal(mine, theirs)
    assert err.field == "info.compat_hash.kv_cache_dtype"
    assert "kv_cache_dtype: the requester has 'auto', this engine has 'fp8_e5m2'" in caplog.text


def test_a_pipeline_stages_fields_are_the_whole_models(configs, monkeypatch) -> None:
    """A worker of stage 0 of two holds 2 of the tiny model's 4 layers (its own ``KVCacheConfig``), but says the
    whole model's layers, as the decode engine (every layer) does: the fields match, and the stages' layer
    ranges are negotiated at the handshake instead (``first_layer``)."""
    import vllm

    from p2pkv.engine_facts import compat_fields

    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    staged = configs(pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert staged.model_config.get_num_layers(staged.parallel_config) == 2
    assert compat_fields(staged, _groups(None, layers=2)) == compat_fields(configs(), _groups(None))
