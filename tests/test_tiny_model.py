"""The tiny random-weight models: every kind writes a checkpoint that transformers and vLLM read as that kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2pkv.tools.tiny_model import KINDS, TinyModelSpec, hf_config, make_tiny_model

ARCHITECTURES = {"llama": "LlamaForCausalLM", "sliding-window": "MistralForCausalLM",
                 "interleaved-window": "LlamaForCausalLM", "mla": "DeepseekV2ForCausalLM",
                 "hybrid": "GraniteMoeHybridForCausalLM"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    return {kind: make_tiny_model(root / kind, TinyModelSpec(kind=kind)) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_written_config_loads_as_its_kind(models, kind) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(models[kind])
    assert config.architectures == [ARCHITECTURES[kind]]
    assert (config.num_hidden_layers, config.vocab_size, config.hidden_size) == (4, 259, 128)
    tokenizer = AutoTokenizer.from_pretrained(models[kind])
    assert tokenizer.encode("héllo") == [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize("héllo")]
    assert len(tokenizer.encode("héllo")) == len("héllo".encode())  # one token per byte
    if kind in ("sliding-window", "interleaved-window"):
        assert config.sliding_window == 40
    if kind == "interleaved-window":
        assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    if kind == "mla":  # vLLM's CPU MLA kernel takes a 576-wide latent only
        assert (config.kv_lora_rank, config.qk_rope_head_dim, config.q_lora_rank) == (512, 64, None)
        assert config.first_k_dense_replace == config.num_hidden_layers  # dense MLPs: no experts built
    if kind == "hybrid":
        assert config.layer_types == ["linear_attention", "full_attention"] * 2
        assert config.num_local_experts == 0


def test_default_is_the_llama_it_always_was(tmp_path) -> None:
    """Same seed, same bytes: the default spec is the dense Llama the demo and tests have used."""
    spec = TinyModelSpec()
    assert spec.kind == "llama"
    config = hf_config(spec, vocab_size=259)
    assert (type(config).__name__, config.num_key_value_heads, config.initializer_range) == ("LlamaConfig", 2, 0.08)
    first = make_tiny_model(tmp_path / "a")
    second = make_tiny_model(tmp_path / "b")
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert json.loads((first / "p2pkv_tiny_model.json").read_text())["kind"] == "llama"


@pytest.mark.parametrize("kind", KINDS)
def test_only_text_tokens_and_eos_can_win_greedy_decoding(models, kind) -> None:
    """Output-embedding rows are zero for every token but printable ASCII, newline and ``</s>``."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    weights = load_file(models[kind] / "model.safetensors")
    (name,) = [n for n in weights if n.endswith("lm_head.weight")]
    live = [i for i, row in enumerate(weights[name]) if row.abs().sum() > 0]
    tokenizer = AutoTokenizer.from_pretrained(models[kind])
    texts = {tokenizer.decode([i], skip_special_tokens=False) for i in live}
    assert texts == {"</s>", "\n", *map(chr, range(0x20, 0x7F))} and len(live) == 97


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind must be one of llama, sliding-window, interleaved-window, mla, "
                                         "hybrid, got 'moe'"):
        hf_config(TinyModelSpec(kind="moe"), vocab_size=259)


def test_vllm_resolves_each_kind_to_its_own_implementation(models) -> None:
    """vLLM maps every kind to its native model class (not the Transformers fallback), MLA on for ``mla``."""
    from vllm.engine.arg_utils import EngineArgs

    for kind, path in models.items():
        config = EngineArgs(model=str(path), dtype="float32", max_model_len=512,
                            enforce_eager=True).create_engine_config()
        assert config.model_config.architecture == ARCHITECTURES[kind], kind
        assert config.model_config.use_mla == (kind == "mla")
        assert config.model_config.is_hybrid == (kind == "hybrid")


def test_cli_writes_the_kind(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "p2pkv.tools.cli", "make-tiny-model", str(tmp_path / "m"),
                          "--kind", "sliding-window", "--sliding-window", "24", "--layers", "2", "--hidden-size",
                          "256", "--heads", "2", "--kv-heads", "1", "--intermediate-size", "64",
                          "--max-position-embeddings", "2048"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"], config["num_hidden_layers"]) == (
        ["MistralForCausalLM"], 24, 2)
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["max_position_embeddings"]) == (256, 2, 1, 64, 2048)
