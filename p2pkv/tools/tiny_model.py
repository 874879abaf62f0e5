"""Write a tiny random-weight model that vLLM loads offline.

Models cannot be downloaded on the machines p2pkv is tested on, so the demo,
the tests and the benchmarks use a small checkpoint made here from a fixed
seed: a byte-level tokenizer (256 byte tokens plus ``<s>``, ``</s>``,
``<unk>``) saved with ``tokenizers`` and random weights saved as
safetensors by ``transformers``. vLLM's own loader reads it.

Kinds (:data:`KINDS`, ``TinyModelSpec.kind``): ``llama`` (the default:
dense Llama, GQA), ``sliding-window`` (Mistral: every layer attends to the
last ``sliding_window`` tokens only), ``interleaved-window`` (Llama with
``layer_types``: sliding-window and full-attention layers alternate, as in
Gemma 2/3 and gpt-oss; vLLM's hybrid KV cache manager keeps one KV cache
group per attention type), ``mla`` (DeepSeek-V2: a latent KV
cache of ``kv_lora_rank`` + ``qk_rope_head_dim`` = 576 elements per token,
the only size vLLM's CPU MLA kernel takes; dense MLPs, no experts) and
``hybrid`` (Granite-4-style ``GraniteMoeHybrid`` without experts: Mamba-2
layers with attention in every second layer).

The weights are drawn with a large ``initializer_range`` so attention is far
from uniform: the next-token distribution depends strongly on the KV cache,
which makes a corrupted or skipped KV transfer visible in tokens and
logprobs. With ``text_output`` (the default) the output-embedding rows of
every token but printable ASCII bytes, newline and ``</s>`` are zero: those
tokens get logit 0 while the others' are spread around it, so greedy
decoding emits readable characters, as a trained model does, instead of
lone UTF-8 continuation bytes (a token that is part of a character changes
how vLLM streams text, and a real model's output rarely starts with one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")
KINDS = ("llama", "sliding-window", "interleaved-window", "mla", "hybrid")
"""Model kinds :func:`make_tiny_model` writes (see the module docstring)."""
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model.

    Attributes:
        num_layers: decoder layers (each one attention layer, so KV layers).
        hidden_size: model width (elements).
        num_heads: attention heads.
        num_kv_heads: KV heads (GQA when smaller than ``num_heads``).
        intermediate_size: MLP width (elements).
        max_position_embeddings: longest sequence (tokens).
        initializer_range: standard deviation of the random weights.
        seed: torch seed; the same seed gives bit-identical weights.
        kind: one of :data:`KINDS`.
        sliding_window: attention window (tokens) of the ``sliding-window`` and
            ``interleaved-window`` kinds (the latter's even layers).
        text_output: zero the output-embedding rows of tokens that are not
            printable ASCII, newline or ``</s>`` (see the module docstring).
    """

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    initializer_range: float = 0.08
    seed: int = 0
    kind: str = "llama"
    sliding_window: int = 40
    text_output: bool = True


def _byte_tokenizer_files(out: Path) -> int:
    """Write a byte-level BPE tokenizer (no merges) to ``out``; returns vocab size (259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return len(vocab)


def _text_token_ids(out: Path) -> list[int]:
    """Ids of ``</s>`` and of the byte tokens for printable ASCII (0x20-0x7E) and newline, from the
    tokenizer written to ``out``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = [i for i in range(tok.get_vocab_size()) if (ch := tok.decode([i])) == "\n" or
            (len(ch) == 1 and " " <= ch <= "~")]
    return [SPECIAL_TOKENS.index("</s>"), *text]


def hf_config(spec: TinyModelSpec, vocab_size: int):
    """The ``transformers`` config (a ``PretrainedConfig``) of ``spec``.

    Raises:
        ValueError: ``spec.kind`` is not one of :data:`KINDS`.
    """
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
                  initializer_range=spec.initializer_range, bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=False, dtype="float32")
    if spec.kind == "llama":
        return transformers.LlamaConfig(**common)
    if spec.kind == "sliding-window":
        return transformers.MistralConfig(**common, sliding_window=spec.sliding_window)
    if spec.kind == "interleaved-window":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)]
        config = transformers.LlamaConfig(**common)
        config.layer_types, config.sliding_window = types, spec.sliding_window  # read by vLLM's Llama
        return config
    if spec.kind == "mla":
        head = spec.hidden_size // spec.num_heads
        return transformers.DeepseekV2Config(
            **{**common, "num_key_value_heads": spec.num_heads}, kv_lora_rank=512, qk_rope_head_dim=64,
            q_lora_rank=None, qk_nope_head_dim=head, v_head_dim=head, head_dim=64,
            first_k_dense_replace=spec.num_layers, n_routed_experts=4, n_shared_experts=1,
            moe_intermediate_size=spec.intermediate_size, num_experts_per_tok=2)
    if spec.kind == "hybrid":
        types = ["mamba" if i % 2 == 0 else "attention" for i in range(spec.num_layers)]
        return transformers.GraniteMoeHybridConfig(
            **common, layer_types=types, num_local_experts=0, shared_intermediate_size=spec.intermediate_size,
            mamba_n_heads=8, mamba_d_head=2 * spec.hidden_size // 8, mamba_d_state=16, mamba_chunk_size=64,
            position_embedding_type="rope")
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Create the tiny model directory (idempotent: an existing one is kept).

    Args:
        out_dir: directory to write ``config.json``, ``model.safetensors`` and
            the tokenizer files into.
        spec: model shape; defaults to :class:`TinyModelSpec()`.

    Returns:
        The model directory as a :class:`~pathlib.Path`.

    Raises:
        ImportError: when ``torch`` or ``transformers`` is not installed.
        ValueError: an unknown ``spec.kind``.
    """
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    marker = out / "p2pkv_tiny_model.json"
    if marker.exists() and json.loads(marker.read_text()) == spec.__dict__:
        return out
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(spec, vocab_size=len(SPECIAL_TOKENS) + 256)
    out.mkdir(parents=True, exist_ok=True)
    _byte_tokenizer_files(out)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    if spec.text_output:
        with torch.no_grad():
            weight = model.get_output_embeddings().weight  # [vocab, hidden] float32
            others = torch.ones(weight.shape[0], dtype=torch.bool)
            others[_text_token_ids(out)] = False
            weight[others] = 0.0
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(spec.__dict__))
    return out


def write_secret(path: Path) -> Path:
    """Write a random side-channel secret (64 hex characters) to ``path`` unless it already holds one.

    For the compose demo, whose one-shot service prepares the shared volume;
    the file is world-readable there (the engines' and the proxy's containers read it).
    """
    import secrets

    if not path.is_file() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o644)
    return path
