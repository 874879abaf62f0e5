"""What a p2pkv engine tells its peers about itself, read off vLLM's config.

:func:`compat_fields`: what prefill and decode must share, compared field by
field at handshake (:mod:`handshake.fingerprints`); :func:`model_info`: the model
and KV cache facts the data plane negotiates with (:mod:`p2pkv.dataplane.negotiate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p2pkv.dataplane.negotiate import ModelInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def compat_fields(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> dict[str, str]:
    """What prefill and decode must share to exchange KV byte for byte, field by field.

    The vLLM minor version, the model (architecture, layers, KV heads, head
    size, dtype), the KV cache dtype (``fp8`` is ``fp8_e4m3``), MLA or not,
    the KV cache groups (spec type, window, layers per group: the HMA group
    structure; for Mamba groups the per-rank state shapes and dtypes, so a
    hybrid model's TP sizes must match) and a drafter whose layers add KV
    (EAGLE, MTP, draft model). Block size, page order (HND/NHD) and TP size
    are negotiated at handshake instead. Sent as a :func:`handshake.fingerprints.fingerprint`; the
    decode side refuses a prefill rank whose fields differ, naming them.

    A worker of a pipeline stage holds only its stage's layers, but its fields are the whole model's (its
    layers and its one KV cache group's layers: :func:`check_stages_supported`), as an engine without stages
    says them: the stages' layer ranges are negotiated at the handshake (``first_layer``).
    """
    import vllm

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    spec = vllm_config.speculative_config
    drafter = "none"
    if spec is not None and spec.uses_draft_kv_cache():
        draft = spec.draft_model_config
        drafter = (f"{spec.method} {draft.model if draft else ''} "
                   f"kv_cache_dtype={spec.kv_cache_dtype or cc.cache_dtype} parallel_drafting={spec.parallel_drafting}")
    staged = pc.pipeline_parallel_size > 1
    num_layers = mc.get_total_num_hidden_layers() if staged else mc.get_num_layers(pc)
    groups = "unknown"
    if kv_cache_config is not None:
        groups = " + ".join(_group(g, num_layers if staged else None) for g in kv_cache_config.kv_cache_groups)
    return {
        "vllm": ".".join(vllm.__version__.split(".")[:2]),
        "architecture": ",".join(getattr(mc.hf_config, "architectures", None) or []),
        "num_layers": str(num_layers),
        "total_num_kv_heads": str(mc.get_total_num_kv_heads()),
        "head_size": str(mc.get_head_size()),
        "model_dtype": str(mc.dtype).removeprefix("torch."),
        "kv_cache_dtype": "fp8_e4m3" if cc.cache_dtype == "fp8" else str(cc.cache_dtype),
        "mla": str(bool(mc.use_mla)),
        "kv_cache_groups": groups,
        "speculative": drafter,
    }


def _group(group: Any, num_layers: int | None = None) -> str:
    """One KV cache group as ``SpecType(window=W)x<layers>`` (block size left out: it is negotiated); ``num_layers``:
    the group's layers in the whole model where this worker holds a pipeline stage's (None: its own).

    A Mamba group also names its state shapes and dtypes (per rank), cache mode and speculative blocks."""
    spec = group.kv_cache_spec
    extra = [f"{name}={getattr(spec, name)}" for name in ("sliding_window", "attention_chunk_size", "shapes",
                                                          "dtypes", "mamba_cache_mode", "num_speculative_blocks")
             if getattr(spec, name, None) is not None]
    draft = " draft" if getattr(group, "is_eagle_group", False) else ""
    layers = len(group.layer_names) if num_layers is None else num_layers
    return f"{type(spec).__name__}({', '.join(extra)}){draft}x{layers}"


class UnsupportedKVCacheError(ValueError):
    """A KV cache group p2pkv cannot move; the message names the group and what to do."""


def _specs(kv_cache_config: KVCacheConfig) -> list[tuple[int, Any]]:
    """``(group index, spec)`` for every KV cache spec, a uniform-type group's layer specs included."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    out = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        out += [(i, s) for s in (spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec])]
    return out


class UnsupportedParallelismError(ValueError):
    """An engine parallelism p2pkv cannot move KV for; the message names the setting and what to do."""


def check_parallelism_supported(pipeline_parallel_size: int, role: str = "both") -> None:
    """Refuse, at engine start, a pipeline-parallel engine that would load KV.

    A prefill engine may run pipeline stages: each stage's workers serve their own layers (their handshake
    names the stage and its first layer, the ``kv_transfer_params`` the ``pp_size``), and a decode rank reads,
    or has pushed, each stage's layers into its matching layers (:mod:`p2pkv.dataplane.stages`). A decode
    engine (role ``decode`` or ``both``) with stages would have to split each load over its own stages: not
    supported. Tensor, data and expert parallelism are supported on both sides.

    Args:
        pipeline_parallel_size: vLLM's ``parallel_config.pipeline_parallel_size``.
        role: the engine's p2pkv role (:func:`p2pkv.config.engine_role`).

    Raises:
        UnsupportedParallelismError: ``pipeline_parallel_size`` > 1 on an engine whose role is not ``prefill``.
    """
    if pipeline_parallel_size > 1 and role != "prefill":
        raise UnsupportedParallelismError(
            f"pipeline_parallel_size={pipeline_parallel_size} with role {role}: p2pkv loads KV only into an engine "
            "without pipeline stages; run the decode engine with --pipeline-parallel-size 1 (spread it with "
            "--tensor-parallel-size), or give this engine role prefill (kv_role kv_producer) if it only prefills")


def check_stages_supported(kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, at the start of a pipeline-parallel prefill engine, a KV cache of several groups.

    A stage's layers pair with the decode rank's matching layers by their place in the model
    (:mod:`p2pkv.dataplane.stages`); a hybrid KV cache (sliding-window and full-attention groups, Mamba state)
    spreads a stage's layers over groups whose layers are numbered per group, which stages do not pair yet.

    Raises:
        UnsupportedParallelismError: more than one KV cache group.
    """
    groups = num_kv_cache_groups(kv_cache_config)
    if groups > 1:
        raise UnsupportedParallelismError(
            f"pipeline_parallel_size > 1 with {groups} KV cache groups (a hybrid model: sliding-window or Mamba "
            "layers): p2pkv moves a pipeline stage's KV for models of one KV cache group only; run this prefill "
            "engine with --pipeline-parallel-size 1")


def check_kv_cache_supported(kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, at engine start, a KV cache with a group p2pkv would move wrongly.

    p2pkv moves attention KV (full, sliding-window, chunked-local, MLA) and
    the Mamba/SSM state of hybrid models (Granite-4, Jamba, Bamba, ...) whose
    state groups share vLLM's block pool and KV tensors with attention groups:
    a state block's page is then one of the attention tensors' pages, moved
    whole. Only vLLM's ``mamba_cache_mode="none"`` (no prefix caching for the
    state: one state block per request) is supported.

    Raises:
        UnsupportedKVCacheError: a group that is neither attention nor Mamba
            state, a Mamba group without an attention group (a pure SSM
            model), or a Mamba group that caches prefix states
            (``--enable-prefix-caching`` with a hybrid model).
    """
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    specs = _specs(kv_cache_config)
    for i, spec in specs:
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "none":
                raise UnsupportedKVCacheError(
                    f"KV cache group {i} is MambaSpec with mamba_cache_mode={spec.mamba_cache_mode!r}: p2pkv moves "
                    "one SSM state per request; start both engines with --no-enable-prefix-caching")
            if not any(isinstance(s, AttentionSpec) for _, s in specs):
                raise UnsupportedKVCacheError(
                    f"KV cache group {i} is MambaSpec and the model has no attention layers: p2pkv moves SSM state "
                    "inside the attention layers' KV pages only; serve this model without P2pKvConnector")
        elif not isinstance(spec, AttentionSpec):
            raise UnsupportedKVCacheError(
                f"KV cache group {i} is {type(spec).__name__}: p2pkv moves attention KV and Mamba/SSM state only; "
                "serve this model without P2pKvConnector (one engine does both phases)")


def has_state_groups(kv_cache_config: KVCacheConfig | None) -> bool:
    """Whether the KV cache holds Mamba/SSM state (a hybrid model): one recurrent state per request."""
    if kv_cache_config is None:
        return False
    from vllm.v1.kv_cache_interface import MambaSpec

    return any(isinstance(spec, MambaSpec) for _, spec in _specs(kv_cache_config))


def state_layer_names(kv_cache_config: KVCacheConfig | None) -> frozenset[str]:
    """Names of the layers whose KV cache group is Mamba/SSM state."""
    if kv_cache_config is None:
        return frozenset()
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    names: set[str] = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            names.update(n for n, s in spec.kv_cache_specs.items() if isinstance(s, MambaSpec))
        elif isinstance(spec, MambaSpec):
            names.update(group.layer_names)
    return frozenset(names)


def layer_groups(kv_cache_config: KVCacheConfig | None) -> dict[str, int]:
    """Layer name → the index of its KV cache group (empty without a config: every layer in group 0)."""
    if kv_cache_config is None:
        return {}
    return {name: i for i, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}


def state_group_indices(kv_cache_config: KVCacheConfig | None) -> frozenset[int]:
    """The indices of the KV cache groups that hold Mamba/SSM state."""
    if kv_cache_config is None:
        return frozenset()
    from vllm.v1.kv_cache_interface import MambaSpec

    return frozenset(i for i, spec in _specs(kv_cache_config) if isinstance(spec, MambaSpec))


def recompute_tokens(kv_cache_config: KVCacheConfig | None) -> int:
    """Trailing prompt tokens the decode engine computes itself instead of loading: 0 or 1.

    1 when vLLM frees blocks behind an attention window
    (:func:`frees_blocks_behind_window`) or the model keeps Mamba/SSM state
    (:func:`has_state_groups`): the state moved is the one after the first
    ``N - 1`` prompt tokens, and the decode engine's step over token ``N - 1``
    advances it (vLLM's NixlConnector backs off one token for Mamba state
    the same way).
    """
    return int(frees_blocks_behind_window(kv_cache_config) or has_state_groups(kv_cache_config))


def num_kv_cache_groups(kv_cache_config: KVCacheConfig | None) -> int:
    """KV cache groups of an engine (at least 1: a config without groups counts as one)."""
    return max(1, len(kv_cache_config.kv_cache_groups)) if kv_cache_config is not None else 1


def frees_blocks_behind_window(kv_cache_config: KVCacheConfig | None) -> bool:
    """Whether vLLM frees a request's blocks behind an attention window in this KV cache.

    True when a group is sliding-window (``SlidingWindowSpec``) or chunked
    local attention (``ChunkedLocalAttentionSpec``): vLLM replaces blocks no
    longer inside the window with its null block (id 0), also just before
    ``request_finished``, computing the window from the tokens computed so
    far. A request whose ``N`` prompt tokens were all computed loses the block
    of token ``N - window`` when ``N - window + 1`` is a multiple of the block
    size, and the last prompt token attends to that token; so
    p2pkv has the prefill engine compute ``N - 1`` tokens and the decode
    engine load those and compute the last one (vLLM's NixlConnector backs off
    one token the same way for Mamba state).
    """
    if kv_cache_config is None:
        return False
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    return any(isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec) for _, spec in _specs(kv_cache_config))


def model_info(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> ModelInfo:
    """This rank's model and KV cache facts, from vLLM's config."""
    from vllm.platforms import current_platform

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    return ModelInfo(
        kv_layout=vllm_config.cache_config.kv_cache_layout or "LBHNC",
        dtype=str(mc.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype,
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        total_num_kv_heads=mc.get_total_num_kv_heads(),
        is_mla=bool(mc.use_mla),
        # vLLM's CPU attention pages (K stored transposed) cannot be told apart by their strides.
        attn_layout="CPU" if current_platform.is_cpu() and not mc.use_mla else None,
        local_attention=frees_blocks_behind_window(kv_cache_config),
        kv_groups=num_kv_cache_groups(kv_cache_config),
        state_groups=has_state_groups(kv_cache_config),
    )
