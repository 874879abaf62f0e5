"""What vLLM's CPU build will run on this machine, and the engine flags p2pkv chooses from it.

vLLM's CPU platform (``vllm/platforms/cpu.py``, ``get_attn_backend_cls`` and
``check_and_update_config``) picks its kernels by the CPU's instruction set:
for an MLA model (DeepSeek-style latent KV) it prefers the AMX backend
(``AMX_MLA``) whenever ``torch.cpu._is_amx_tile_supported()`` is true on
x86, and that backend refuses float32 weights; elsewhere it runs the
reference backend (``CPU_MLA``), which takes float32 and 16-token blocks
only. The same engine command line therefore starts on one CPU and fails on
another. :func:`choose` makes the choice explicit from a :class:`CpuReport`
instead, so a pair runs the same kernels on every CPU, and says why in
:attr:`EngineChoice.reasons`; :func:`p2pkv.tools.deploy.engines.fit_to_cpu` applies it to an engine's
flags and logs each reason.

The rule (pure, tested with made-up reports in ``tests/test_cpu_backend.py``):

- MLA model in float32: ``--attention-backend CPU_MLA`` on every CPU (the
  one MLA backend that takes float32; with AMX, vLLM would otherwise pick
  ``AMX_MLA`` and refuse the weights), and 16-token blocks (its only size).
- MLA model in bfloat16/float16 on a CPU with AMX tiles: vLLM's ``AMX_MLA``
  as it prefers, with blocks a multiple of 32 (that backend's constraint);
  without AMX, ``CPU_MLA`` with 16-token blocks.
- Any other model: vLLM's ``CPU_ATTN`` (its only CPU backend for standard
  attention); no flag, nothing changed.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8",
             "amx_fp16", "asimd", "sve", "bf16")
"""``/proc/cpuinfo`` flags that vLLM's CPU kernels dispatch on (x86: AVX2, AVX-512 and its BF16/FP16/VNNI
extensions, AMX tiles; aarch64: NEON ``asimd``, SVE, BF16), printed by ``p2pkv doctor``."""

MlaBackend = Literal["CPU_MLA", "AMX_MLA"]
"""vLLM's two CPU MLA backends (``AttentionBackendEnum`` names)."""

CPU_MLA_BLOCK = 16
"""The only block size (tokens) vLLM's reference CPU MLA decode kernel is built for (``csrc/cpu/mla_decode.cpp``)."""
AMX_MLA_BLOCK_MULTIPLE = 32
"""vLLM's AMX MLA backend takes block sizes (tokens) that are multiples of this."""
FLOAT32 = ("float32", "float")
"""``--dtype`` values that mean float32."""


@dataclass(frozen=True)
class CpuReport:
    """What this machine's CPU offers vLLM's CPU kernels.

    Attributes:
        arch: ``platform.machine()`` (``x86_64``, ``aarch64``, ...).
        capability: PyTorch's kernel ISA level, ``torch.backends.cpu.get_cpu_capability()``
            (``AVX512``, ``AVX2``, ``DEFAULT``, ...).
        amx_tile: ``torch.cpu._is_amx_tile_supported()``: the test vLLM itself uses to prefer ``AMX_MLA``.
        avx512_bf16: ``torch.cpu._is_avx512_bf16_supported()``.
        flags: which of :data:`CPU_FLAGS` ``/proc/cpuinfo`` lists (empty where it cannot be read).
    """

    arch: str
    capability: str
    amx_tile: bool
    avx512_bf16: bool
    flags: frozenset[str] = frozenset()

    def summary(self) -> str:
        """One line for logs and ``p2pkv doctor``: arch, ISA level, AMX, the flags."""
        flags = " ".join(f for f in CPU_FLAGS if f in self.flags) or "none read"
        return (f"{self.arch}, torch ISA {self.capability}, AMX tiles {'yes' if self.amx_tile else 'no'}, "
                f"AVX-512 BF16 {'yes' if self.avx512_bf16 else 'no'}; flags: {flags}")


def read_cpu_report(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuReport:
    """This machine's :class:`CpuReport` (imports torch; reads ``cpuinfo`` when it exists)."""
    import torch

    flags: set[str] = set()
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return CpuReport(arch=platform.machine(), capability=torch.backends.cpu.get_cpu_capability(),
                     amx_tile=bool(torch.cpu._is_amx_tile_supported()),
                     avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
                     flags=frozenset(flags & set(CPU_FLAGS)))


@dataclass(frozen=True)
class EngineChoice:
    """The CPU-dependent engine flags :func:`choose` settled on.

    Attributes:
        attention_backend: ``--attention-backend`` to pass (None: vLLM's own choice, which is the only one).
        block_size: tokens per KV block the engine must use.
        reasons: one sentence per choice made, for the launcher's log (empty: nothing depended on the CPU).
    """

    attention_backend: MlaBackend | None
    block_size: int
    reasons: tuple[str, ...]


def model_uses_mla(model: str) -> bool:
    """Whether the model directory's ``config.json`` describes MLA (a ``kv_lora_rank``, as vLLM reads it).

    A model name that is not a local directory (a hub id) or a config that cannot be read counts as not MLA.
    """
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("kv_lora_rank") is not None


def model_dtype(model: str, dtype: str) -> str:
    """The dtype ``--dtype dtype`` gives the model: ``dtype`` itself, or for ``auto`` the config's
    ``torch_dtype`` / ``dtype`` (``float32`` where neither is set or readable, as for a CPU engine)."""
    if dtype != "auto":
        return dtype
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    value = (config.get("torch_dtype") or config.get("dtype")) if isinstance(config, dict) else None
    return value if isinstance(value, str) else "float32"


def choose(report: CpuReport, *, use_mla: bool, dtype: str, block_size: int) -> EngineChoice:
    """The attention backend and block size for an engine on a CPU described by ``report``.

    Args:
        report: the CPU (:func:`read_cpu_report`, or made up in tests).
        use_mla: whether the model is MLA (:func:`model_uses_mla`).
        dtype: the model's dtype (:func:`model_dtype`).
        block_size: the block size asked for (tokens).

    Returns:
        The choice, with a reason per flag set; see the module docstring for the rule.
    """
    if not use_mla:
        return EngineChoice(None, block_size, ())
    amx = report.arch in ("x86_64", "AMD64") and report.amx_tile
    if dtype in FLOAT32 or not amx:
        why = ("vLLM's AMX_MLA backend, which it prefers on this CPU (AMX tiles), refuses float32 weights"
               if amx and dtype in FLOAT32 else "this CPU has no AMX tiles, so vLLM's AMX_MLA backend cannot run")
        reasons = [f"--attention-backend CPU_MLA for this MLA model in {dtype} ({why}; CPU: {report.summary()})"]
        if block_size != CPU_MLA_BLOCK:
            reasons.append(f"--block-size {CPU_MLA_BLOCK} instead of {block_size}: "
                           f"CPU_MLA's decode kernel takes {CPU_MLA_BLOCK}-token blocks only")
        return EngineChoice("CPU_MLA", CPU_MLA_BLOCK, tuple(reasons))
    reasons = [f"--attention-backend AMX_MLA for this MLA model in {dtype} (AMX tiles; CPU: {report.summary()})"]
    chosen = block_size
    if block_size % AMX_MLA_BLOCK_MULTIPLE:
        chosen = -(-block_size // AMX_MLA_BLOCK_MULTIPLE) * AMX_MLA_BLOCK_MULTIPLE
        reasons.append(f"--block-size {chosen} instead of {block_size}: AMX_MLA takes multiples of "
                       f"{AMX_MLA_BLOCK_MULTIPLE} tokens")
    return EngineChoice("AMX_MLA", chosen, tuple(reasons))


_REPORT: CpuReport | None = None


def this_cpu() -> CpuReport:
    """This machine's :class:`CpuReport`, read once per process."""
    global _REPORT
    if _REPORT is None:
        _REPORT = read_cpu_report()
    return _REPORT
