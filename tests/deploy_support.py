"""Shared helpers of the deployment-artifact tests: paths, tools, and a strict ``p2pkv`` argument check."""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from p2pkv.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
WORKFLOWS = ROOT / ".github" / "workflows"
DASHBOARD = DOCKER / "grafana" / "p2pkv-dashboard.json"
MANIFESTS = ("models.yaml", "prefill.yaml", "decode.yaml", "proxy.yaml", "networkpolicy.yaml")
K8S_VERSIONS = ("1.29.0", "1.37.0")
"""Kubernetes releases the manifests are validated against (oldest and newest checked)."""
ENGINE_PORTS = {"prefill": 8100, "decode": 8200}
RDMA_RESOURCE = "rdma/ib"
TEST_EXTRA = "install the test extra: pip install -e '.[test]'"


def tool(name: str) -> str:
    """Path of a console script installed beside this Python, else on PATH; skips when absent."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed ({TEST_EXTRA})")
    return found


def run_tool(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a checker; its exit status and output come back (no exception on failure)."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def check_jsonschema(schema: str, path: Path) -> subprocess.CompletedProcess[str]:
    """``check-jsonschema --builtin-schema SCHEMA PATH`` with the bundled (offline) schema copies."""
    pytest.importorskip("check_jsonschema", reason=f"check-jsonschema not installed ({TEST_EXTRA})")
    return run_tool([sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, str(path)])


def load_all(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document in ``path``."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    """The sub-command parser ``name`` of ``parser``, or None."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def parse_p2pkv(argv: list[str]) -> argparse.Namespace:
    """Parse ``p2pkv`` arguments (without the program name) like the console script does.

    Stricter than argparse: every ``--flag`` must be spelled out in full
    (argparse would accept an unambiguous prefix).

    Raises:
        ValueError: unknown subcommand, unknown or abbreviated flag, bad value.
    """
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:
        raise ValueError(f"p2pkv {shlex.join(argv)}: rejected by the p2pkv parser") from exc
    leaf = parser
    for word in argv:
        if word.startswith("-"):
            break
        sub = subparser(leaf, word)
        if sub is None:
            break
        leaf = sub
    known = {opt for action in leaf._actions for opt in action.option_strings}
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            raise ValueError(f"p2pkv {shlex.join(argv)}: {flag} is not a flag of this subcommand")
    return ns


def launch_roles() -> set[str]:
    """The ``p2pkv launch`` pod modes this p2pkv has."""
    launch = subparser(build_parser(), "launch")
    assert launch is not None, "p2pkv has no launch subcommand"
    return {name for name in ("prefill", "decode") if subparser(launch, name) is not None}


def require_launch_role(role: str) -> None:
    """Fail when ``p2pkv launch ROLE`` does not exist: the manifests run it, so its going missing is a
    regression (never a skip)."""
    if role not in launch_roles():
        pytest.fail(f"`p2pkv launch {role}` is missing from the p2pkv CLI, but the deployment files run it")


def host_port(value: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``."""
    host, _, port = value.rpartition(":")
    return host, int(port)
