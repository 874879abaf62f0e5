"""Dockerfiles (linted with hadolint) and the Compose file (schema + every ``p2pkv`` command parsed).

Nothing here builds an image or starts a container; each check has a negative control showing it can fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_support import (
    DOCKER,
    ROOT,
    check_jsonschema,
    host_port,
    parse_p2pkv,
    require_launch_role,
    run_tool,
    tool,
)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
    return out


def cpu_dockerfile_problems(text: str) -> list[str]:
    """What keeps a Dockerfile from running the README's install script and demo (empty: nothing)."""
    instr = dockerfile_instructions(text)
    problems = []
    copy_at = [i for i, (k, a) in enumerate(instr) if k == "COPY" and re.fullmatch(r"(--\S+ )*\. /app/?", a)]
    setup_at = [i for i, (k, a) in enumerate(instr) if k == "RUN" and a == "bash scripts/setup.sh"]
    if not copy_at:
        problems.append("no `COPY . /app`")
    if not setup_at:
        problems.append("no `RUN bash scripts/setup.sh`")
    if copy_at and setup_at and setup_at[0] < copy_at[0]:
        problems.append("scripts/setup.sh runs before the sources are copied")
    workdirs = [a for k, a in instr if k == "WORKDIR"]
    if not workdirs or workdirs[-1].rstrip("/") != "/app":
        problems.append("WORKDIR is not /app")
    cmds = [a for k, a in instr if k == "CMD"]
    if not cmds or json.loads(cmds[-1]) != ["bash", "scripts/demo.sh"]:
        problems.append('CMD is not ["bash", "scripts/demo.sh"]')
    other_installs = [a for k, a in instr if k == "RUN" and re.search(r"\bpip3? install\b", a)]
    if other_installs:
        problems.append(f"installs outside scripts/setup.sh: {other_installs}")
    return problems


def test_dockerfile_parser_joins_continuations() -> None:
    text = "FROM x:1\n# note\nRUN a \\\n    && b \\\n    # inner comment\n    && c\nCMD [\"d\"]\n"
    assert dockerfile_instructions(text) == [("FROM", "x:1"), ("RUN", "a && b && c"), ("CMD", '["d"]')]


def test_cpu_dockerfile_runs_the_readme_install_and_demo() -> None:
    text = (DOCKER / "Dockerfile.cpu").read_text()
    assert cpu_dockerfile_problems(text) == []
    # The scripts it runs are the README's.
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/demo.sh" in readme
    assert (ROOT / "scripts" / "setup.sh").is_file() and (ROOT / "scripts" / "demo.sh").is_file()
    assert "bash scripts/setup.sh" in (ROOT / "scripts" / "demo.sh").read_text()
    base = next(a for k, a in dockerfile_instructions(text) if k == "FROM")
    assert re.fullmatch(r"python:3\.12(\.\d+)?-slim-bookworm", base), base


@pytest.mark.parametrize(("old", "new", "problem"), [
    ("RUN bash scripts/setup.sh", "RUN pip install .", "no `RUN bash scripts/setup.sh`"),
    ('CMD ["bash", "scripts/demo.sh"]', 'CMD ["p2pkv", "demo"]', "CMD is not"),
    ("COPY --chown=10001:10001 . /app", "COPY scripts /app/scripts", "no `COPY . /app`"),
])
def test_cpu_dockerfile_check_rejects_other_install_steps(old: str, new: str, problem: str) -> None:
    text = (DOCKER / "Dockerfile.cpu").read_text()
    assert old in text
    problems = cpu_dockerfile_problems(text.replace(old, new))
    assert any(p.startswith(problem) for p in problems), problems


def test_gpu_dockerfile_contents() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml with tomllib")
    instr = dockerfile_instructions((DOCKER / "Dockerfile.gpu").read_text())
    base = next(a for k, a in instr if k == "FROM")
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-runtime-ubuntu(\d+\.\d+)", base)
    assert m, f"base image {base!r}: expected a pinned nvidia/cuda X.Y.Z runtime Ubuntu tag"
    cuda_major = m.group(1)
    runs = " ".join(a for k, a in instr if k == "RUN")
    assert "vllm==0.33.0" in runs
    extra = re.search(r"\[(nixl-cu\d+)\]", runs)
    assert extra, "p2pkv is not installed with a nixl-cuXX extra"
    assert extra.group(1) == f"nixl-cu{cuda_major}", f"{extra.group(1)} on a CUDA {cuda_major} base"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra.group(1) in extras
    for pkg in ("rdma-core", "ibverbs-providers", "libibverbs1", "librdmacm1", "ibverbs-utils",
                "infiniband-diags", "python3"):
        assert re.search(rf"\s{re.escape(pkg)}(t64)?\s", runs + " "), f"apt package {pkg} missing"
    assert "--no-install-recommends" in runs and "rm -rf /var/lib/apt/lists/*" in runs
    assert next(a for k, a in reversed(instr) if k == "ENTRYPOINT") == '["p2pkv"]'
    user = next(a for k, a in reversed(instr) if k == "USER")
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0", f"USER {user}: expected a numeric non-root uid"


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerignore_keeps_local_environments_out(name: str) -> None:
    ignored = {line.strip() for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines()}
    assert {".venv", ".git", ".p2pkv"} <= ignored


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_hadolint_passes(name: str) -> None:
    hadolint = tool("hadolint")
    result = run_tool([hadolint, "--no-color", str(DOCKER / name)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_rejects_a_sloppy_dockerfile(tmp_path: Path) -> None:
    hadolint = tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\nUSER p2pkv\n")
    result = run_tool([hadolint, "--no-color", str(bad)])
    assert result.returncode != 0
    for rule in ("DL3006", "DL3015", "DL3009"):  # untagged base, recommends, apt lists kept
        assert rule in result.stdout, result.stdout


# --------------------------------------------------------------------------- Compose


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _flag(argv: list[str], flag: str) -> list[str]:
    """The values after ``flag`` (up to the next flag)."""
    i = argv.index(flag)
    out = []
    for word in argv[i + 1:]:
        if word.startswith("--"):
            break
        out.append(word)
    return out


def compose_problems(compose: dict[str, Any]) -> list[str]:
    """Cross-checks of the Compose file's services and ``p2pkv`` commands (empty: none found)."""
    services = compose.get("services", {})
    problems = []
    if set(services) != {"model", "prefill", "decode", "proxy"}:
        problems.append(f"services {sorted(services)}")
        return problems
    parsed = {}
    for name, svc in services.items():
        cmd = svc.get("command")
        if not (isinstance(cmd, list) and cmd and cmd[0] == "p2pkv"):
            problems.append(f"{name}: command {cmd!r} is not a p2pkv command list")
            continue
        try:
            parsed[name] = parse_p2pkv(cmd[1:])
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        return problems
    if parsed["model"].command != "make-tiny-model":
        problems.append("model: not `p2pkv make-tiny-model`")
    model_dir = parsed["model"].out
    for role in ("prefill", "decode"):
        ns = parsed[role]
        if (ns.command, getattr(ns, "mode", None)) != ("launch", role):
            problems.append(f"{role}: not `p2pkv launch {role}`")
            continue
        if ns.model != model_dir:
            problems.append(f"{role}: --model {ns.model} is not the model service's {model_dir}")
        if ns.port is None or f":{ns.port}/health" not in " ".join(services[role]["healthcheck"]["test"]):
            problems.append(f"{role}: healthcheck does not probe /health on --port {ns.port}")
        if services[role].get("depends_on", {}).get("model", {}).get("condition") != \
                "service_completed_successfully":
            problems.append(f"{role}: does not wait for the model service")
        if any(not str(v).startswith("models:") for v in services[role].get("volumes", [])):
            problems.append(f"{role}: unexpected volumes")
    proxy = parsed["proxy"]
    if proxy.command != "proxy":
        problems.append("proxy: not `p2pkv proxy`")
    else:
        for role in ("prefill", "decode"):
            targets = [host_port(v) for v in getattr(proxy, role)]
            if targets != [(role, parsed[role].port)]:
                problems.append(f"proxy: --{role} {getattr(proxy, role)} is not the {role} service's port")
            if services["proxy"].get("depends_on", {}).get(role, {}).get("condition") != "service_healthy":
                problems.append(f"proxy: does not wait for a healthy {role}")
        if f":{proxy.port}/health" not in " ".join(services["proxy"]["healthcheck"]["test"]):
            problems.append("proxy: healthcheck does not probe its /health")
    secret = parsed["model"].secret_file
    for name in ("prefill", "decode", "proxy"):  # without the secret the engines and the proxy exit 2
        if secret is None or getattr(parsed[name], "secret_file", None) != secret:
            problems.append(f"{name}: --secret-file is not the one the model service writes ({secret})")
    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            source = str(vol).split(":", 1)[0]
            if not source.startswith(("/", ".")) and source not in declared:
                problems.append(f"{name}: volume {source} is not declared")
    return problems


def test_compose_matches_the_compose_spec() -> None:
    result = check_jsonschema("vendor.compose-spec", DOCKER / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_spec_check_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = _compose()
    broken["services"]["proxy"]["depends_on"]["prefill"]["condition"] = "service_up"
    broken["services"]["decode"]["healthcheck"]["retries"] = "many"
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = check_jsonschema("vendor.compose-spec", path)
    assert result.returncode != 0, result.stdout


def test_compose_services_run_real_p2pkv_commands() -> None:
    for role in ("prefill", "decode"):
        require_launch_role(role)
    assert compose_problems(_compose()) == []


@pytest.mark.parametrize(("service", "old", "new", "problem"), [
    ("prefill", "--side-channel-port", "--side-chanel-port", "prefill: p2pkv launch prefill"),
    ("decode", "decode", "decoder", "decode: p2pkv launch decoder"),
    ("proxy", "prefill:8100", "prefill:8200", "proxy: --prefill"),
    ("proxy", "/models/side-channel-secret", "/models/other-secret", "proxy: --secret-file"),
    ("decode", "/models/tiny", "/models/small", "decode: --model"),
    ("model", "make-tiny-model", "make-tiny-models", "model: p2pkv make-tiny-models"),
])
def test_compose_check_rejects_wrong_commands(service: str, old: str, new: str, problem: str) -> None:
    for role in ("prefill", "decode"):
        require_launch_role(role)
    compose = _compose()
    cmd = compose["services"][service]["command"]
    assert old in cmd
    compose["services"][service]["command"] = [new if w == old else w for w in cmd]
    problems = compose_problems(compose)
    assert any(p.startswith(problem) for p in problems), problems


def test_parse_p2pkv_refuses_abbreviated_flags() -> None:
    assert parse_p2pkv(["proxy", "--prefill", "a:1", "--decode", "b:2"]).command == "proxy"
    with pytest.raises(ValueError, match="--pref is not a flag"):
        parse_p2pkv(["proxy", "--pref", "a:1", "--decode", "b:2"])
    with pytest.raises(ValueError, match="rejected"):
        parse_p2pkv(["proxi", "--prefill", "a:1", "--decode", "b:2"])
