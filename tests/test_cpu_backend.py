"""The CPU-dependent engine choices (:mod:`p2pkv.tools.deploy.cpu_backend`), checked on every machine with
made-up CPU reports: an AMX host (Sapphire Rapids), an AVX-512 host without AMX, an AVX2 host, aarch64."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from p2pkv.tools.deploy.cpu_backend import (
    CpuReport,
    choose,
    model_dtype,
    model_uses_mla,
    read_cpu_report,
)
from p2pkv.tools.deploy.engines import EngineSpec, fit_to_cpu
from p2pkv.tools.deploy.local import LocalPair
from p2pkv.tools.tiny_model import TinyModelSpec, make_tiny_model

AMX = CpuReport("x86_64", "AVX512", amx_tile=True, avx512_bf16=True,
                flags=frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}))
AVX512 = CpuReport("x86_64", "AVX512", amx_tile=False, avx512_bf16=False, flags=frozenset({"avx2", "avx512f"}))
AVX2 = CpuReport("x86_64", "AVX2", amx_tile=False, avx512_bf16=False, flags=frozenset({"avx2"}))
ARM = CpuReport("aarch64", "DEFAULT", amx_tile=False, avx512_bf16=False, flags=frozenset({"asimd"}))
CPUS = {"amx": AMX, "avx512": AVX512, "avx2": AVX2, "aarch64": ARM}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_mla_in_float32_runs_cpu_mla_on_every_cpu(cpu: str) -> None:
    """float32 MLA: the reference backend everywhere (AMX_MLA refuses float32), its 16-token blocks."""
    choice = choose(CPUS[cpu], use_mla=True, dtype="float32", block_size=32)
    assert choice.attention_backend == "CPU_MLA" and choice.block_size == 16
    assert choice.reasons[0].startswith("--attention-backend CPU_MLA for this MLA model in float32")
    assert ("refuses float32 weights" in choice.reasons[0]) == (cpu == "amx")
    assert "--block-size 16 instead of 32" in choice.reasons[1]


@pytest.mark.parametrize(("block", "chosen"), [(32, 32), (16, 32), (64, 64), (40, 64)])
def test_mla_in_bfloat16_with_amx_runs_amx_mla_on_blocks_of_32(block: int, chosen: int) -> None:
    choice = choose(AMX, use_mla=True, dtype="bfloat16", block_size=block)
    assert choice.attention_backend == "AMX_MLA" and choice.block_size == chosen
    assert len(choice.reasons) == (1 if block == chosen else 2)


@pytest.mark.parametrize("cpu", ["avx512", "avx2", "aarch64"])
def test_mla_in_bfloat16_without_amx_runs_cpu_mla(cpu: str) -> None:
    choice = choose(CPUS[cpu], use_mla=True, dtype="bfloat16", block_size=16)
    assert choice.attention_backend == "CPU_MLA" and choice.block_size == 16
    assert "no AMX tiles" in choice.reasons[0] and len(choice.reasons) == 1


@pytest.mark.parametrize("cpu", list(CPUS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_standard_attention_is_left_to_vllm(cpu: str, dtype: str) -> None:
    """No MLA: vLLM's CPU_ATTN is the only backend; nothing is chosen, nothing logged."""
    choice = choose(CPUS[cpu], use_mla=False, dtype=dtype, block_size=32)
    assert choice.attention_backend is None and choice.block_size == 32 and choice.reasons == ()


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MLA model directory."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "mla", TinyModelSpec(kind="mla"))


def test_the_model_kind_and_dtype_come_from_its_config(tmp_path: Path, mla: Path, tiny_model: Path) -> None:
    llama = tiny_model
    assert model_uses_mla(str(mla)) and not model_uses_mla(str(llama)) and not model_uses_mla("org/hub-id")
    assert model_dtype(str(mla), "auto") == "float32" and model_dtype(str(mla), "bfloat16") == "bfloat16"
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "kv_lora_rank": 8}))
    assert model_dtype(str(tmp_path / "bf16"), "auto") == "bfloat16"
    assert model_dtype(str(tmp_path / "none"), "auto") == "float32"


def test_fit_to_cpu_sets_the_flags_and_logs_each_choice(mla: Path, tiny_model: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    spec = EngineSpec(name="prefill", model=str(mla), port=1, role="prefill", block_size=32)
    with caplog.at_level(logging.INFO, logger="p2pkv.launch"):
        fitted = fit_to_cpu(spec, AMX)
    argv = fitted.command()
    assert argv[argv.index("--attention-backend") + 1] == "CPU_MLA"
    assert argv[argv.index("--block-size") + 1] == "16"
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and all(m.startswith("p2pkv launch [prefill]: ") for m in logged)
    assert "AMX tiles yes" in logged[0]
    llama = EngineSpec(name="decode", model=str(tiny_model), port=2)
    assert fit_to_cpu(llama, AMX) is llama and "--attention-backend" not in llama.command()


def test_a_local_pair_of_an_mla_model_starts_cpu_mla_here(mla: Path) -> None:
    """This machine's own report, through the launcher: the pair's commands name the backend."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU engine's backend is vLLM's CUDA choice")
    for spec in LocalPair(model=str(mla), aggregated_port=9999).engine_specs():
        argv = spec.command()
        assert argv[argv.index("--attention-backend") + 1] == "CPU_MLA", spec.name


def test_this_machines_report_reads_its_isa() -> None:
    report = read_cpu_report()
    assert report.arch and report.capability
    assert report.summary().startswith(f"{report.arch}, torch ISA {report.capability}, AMX tiles ")
