"""GitHub Actions workflows: schema-checked, and every ``p2pkv`` command they run parsed.

Each check has a negative control showing it can fail.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_support import (
    ROOT,
    WORKFLOWS,
    check_jsonschema,
    parse_p2pkv,
)
from tests.script_loader import load_script


def _workflow(name: str) -> dict[str, Any]:
    wf = yaml.safe_load((WORKFLOWS / name).read_text())
    if True in wf:  # YAML 1.1 reads the key `on` as a boolean
        wf["on"] = wf.pop(True)
    return wf


def _run_lines(wf: dict[str, Any]) -> list[str]:
    """Every ``run:`` script's logical lines (continuations joined)."""
    lines = []
    for job in wf["jobs"].values():
        for step in job["steps"]:
            text = step.get("run", "").replace("\\\n", " ")
            lines += [line.strip() for line in text.splitlines() if line.strip()]
    return lines


def _p2pkv_invocations(lines: list[str], program: str = "p2pkv") -> list[list[str]]:
    """The arguments of every call of ``program`` (a command, or a script's path) in ``lines``."""
    out = []
    for line in lines:
        words = shlex.split(line.split("|")[0])
        for i, word in enumerate(words):
            if word == program or word.endswith("/" + program):
                out.append(words[i + 1:])
    return out


@pytest.mark.parametrize("name", ["ci.yml", "gpu-ib.yml"])
def test_workflow_matches_the_github_workflow_schema(name: str) -> None:
    for schema in ("vendor.github-workflows", "custom.github-workflows-require-timeout"):
        result = check_jsonschema(schema, WORKFLOWS / name)
        assert result.returncode == 0, f"{schema}: {result.stdout}{result.stderr}"


@pytest.mark.parametrize(("schema", "key", "value"), [
    ("vendor.github-workflows", "runs-onn", "ubuntu-latest"),
    ("custom.github-workflows-require-timeout", "timeout-minutes", None),
])
def test_workflow_schema_check_rejects_a_broken_workflow(tmp_path: Path, schema: str, key: str, value: Any) -> None:
    wf = _workflow("ci.yml")
    job = wf["jobs"]["test"]
    if value is None:
        del job[key]
    else:
        job[key] = job.pop("runs-on")
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(wf))
    assert check_jsonschema(schema, path).returncode != 0


def test_ci_workflow_runs_the_ci_entry_point() -> None:
    wf = _workflow("ci.yml")
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] == 60
    steps = job["steps"]
    assert any(s.get("uses", "").startswith("actions/checkout@") for s in steps)
    py = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python@"))
    assert str(py["with"]["python-version"]) == "3.12"
    assert "bash .ci/run" in _run_lines(wf)
    assert (ROOT / ".ci" / "run").is_file()


def _uploads(job: dict[str, Any]) -> str:
    """Every path the job's upload-artifact steps name, one text."""
    steps = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")]
    return "\n".join(s["with"]["path"] for s in steps)


def test_gpu_workflow_jobs_and_commands() -> None:
    wf = _workflow("gpu-ib.yml")
    assert {"workflow_dispatch", "schedule"} <= set(wf["on"])
    for job in wf["jobs"].values():
        assert job["runs-on"][:4] == ["self-hosted", "linux", "gpu", "infiniband"]
        assert job["timeout-minutes"] > 0
    lines = _run_lines(wf)
    assert any("pytest -m gpu" in line for line in lines)
    assert re.search(r'^\s*"gpu:', (ROOT / "pyproject.toml").read_text(), re.MULTILINE), "no gpu marker"
    invoked = _p2pkv_invocations(lines)
    commands = [parse_p2pkv(argv) for argv in invoked]
    kinds = {(ns.command, getattr(ns, "bench_command", None)) for ns in commands}
    assert {("demo", None), ("doctor", None)} <= kinds
    parser = load_script("bench_transfer").build_parser()
    benches: list[tuple[dict[str, Any], argparse.Namespace]] = []
    for job in wf["jobs"].values():
        for argv in _p2pkv_invocations(_run_lines({"jobs": {"job": job}}), "scripts/bench_transfer.py"):
            benches.append((job, parser.parse_args(argv)))
    # One node: GPU memory, side channel on the runner's IB address, results uploaded.
    ((job, bench),) = benches
    assert bench.device == "cuda" and bench.host.startswith("$") and bench.json and bench.json in _uploads(job)
    # Only scripts that exist.
    for path in re.findall(r"(?:scripts|\.ci)/[\w./-]+", " ".join(lines)):
        assert (ROOT / path).exists(), f"{path} does not exist"
