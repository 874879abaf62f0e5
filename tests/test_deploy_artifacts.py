"""Deployment artifacts: Dockerfiles, Compose file, Kubernetes manifests, CI workflows, Grafana dashboard.

Nothing here builds an image or starts a container: the Dockerfiles are
linted (hadolint), the manifests are validated against Kubernetes' OpenAPI
schemas (kubernetes-validate), the Compose file and the workflows against
their JSON schemas (check-jsonschema's bundled copies), and every ``p2pkv``
command they run is parsed with the real ``p2pkv`` argument parser. Each
check has a negative control showing that it can fail.
"""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from p2pkv.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
WORKFLOWS = ROOT / ".github" / "workflows"
DASHBOARD = DOCKER / "grafana" / "p2pkv-dashboard.json"
MANIFESTS = ("models.yaml", "prefill.yaml", "decode.yaml", "proxy.yaml")
K8S_VERSIONS = ("1.29.0", "1.37.0")
"""Kubernetes releases the manifests are validated against (oldest and newest checked)."""
ENGINE_PORTS = {"prefill": 8100, "decode": 8200}
RDMA_RESOURCE = "rdma/ib"
TEST_EXTRA = "install the test extra: pip install -e '.[test]'"


# --------------------------------------------------------------------------- helpers


def _tool(name: str) -> str:
    """Path of a console script installed beside this Python, else on PATH; skips when absent."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed ({TEST_EXTRA})")
    return found


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def _check_jsonschema(schema: str, path: Path) -> subprocess.CompletedProcess[str]:
    """``check-jsonschema --builtin-schema SCHEMA PATH`` with the bundled (offline) schema copies."""
    pytest.importorskip("check_jsonschema", reason=f"check-jsonschema not installed ({TEST_EXTRA})")
    return _run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, str(path)])


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
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
        sub = _subparser(leaf, word)
        if sub is None:
            break
        leaf = sub
    known = {opt for action in leaf._actions for opt in action.option_strings}
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            raise ValueError(f"p2pkv {shlex.join(argv)}: {flag} is not a flag of this subcommand")
    return ns


def _launch_roles() -> set[str]:
    launch = _subparser(build_parser(), "launch")
    assert launch is not None, "p2pkv has no launch subcommand"
    return {name for name in ("prefill", "decode") if _subparser(launch, name) is not None}


def _require_launch_role(role: str) -> None:
    if role not in _launch_roles():
        pytest.skip(f"`p2pkv launch {role}` is not in this p2pkv yet; its command lines cannot be parsed")


def _host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


# --------------------------------------------------------------------------- Dockerfiles


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
    hadolint = _tool("hadolint")
    result = _run([hadolint, "--no-color", str(DOCKER / name)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_rejects_a_sloppy_dockerfile(tmp_path: Path) -> None:
    hadolint = _tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\nUSER p2pkv\n")
    result = _run([hadolint, "--no-color", str(bad)])
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
            targets = [_host_port(v) for v in getattr(proxy, role)]
            if targets != [(role, parsed[role].port)]:
                problems.append(f"proxy: --{role} {getattr(proxy, role)} is not the {role} service's port")
            if services["proxy"].get("depends_on", {}).get(role, {}).get("condition") != "service_healthy":
                problems.append(f"proxy: does not wait for a healthy {role}")
        if f":{proxy.port}/health" not in " ".join(services["proxy"]["healthcheck"]["test"]):
            problems.append("proxy: healthcheck does not probe its /health")
    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            source = str(vol).split(":", 1)[0]
            if not source.startswith(("/", ".")) and source not in declared:
                problems.append(f"{name}: volume {source} is not declared")
    return problems


def test_compose_matches_the_compose_spec() -> None:
    result = _check_jsonschema("vendor.compose-spec", DOCKER / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_spec_check_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = _compose()
    broken["services"]["proxy"]["depends_on"]["prefill"]["condition"] = "service_up"
    broken["services"]["decode"]["healthcheck"]["retries"] = "many"
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = _check_jsonschema("vendor.compose-spec", path)
    assert result.returncode != 0, result.stdout


def test_compose_services_run_real_p2pkv_commands() -> None:
    for role in ("prefill", "decode"):
        _require_launch_role(role)
    assert compose_problems(_compose()) == []


@pytest.mark.parametrize(("service", "old", "new", "problem"), [
    ("prefill", "--side-channel-port", "--side-chanel-port", "prefill: p2pkv launch prefill"),
    ("decode", "decode", "decoder", "decode: p2pkv launch decoder"),
    ("proxy", "prefill:8100", "prefill:8200", "proxy: --prefill"),
    ("decode", "/models/tiny", "/models/small", "decode: --model"),
    ("model", "make-tiny-model", "make-tiny-models", "model: p2pkv make-tiny-models"),
])
def test_compose_check_rejects_wrong_commands(service: str, old: str, new: str, problem: str) -> None:
    for role in ("prefill", "decode"):
        _require_launch_role(role)
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


# --------------------------------------------------------------------------- Kubernetes


def _k8s_docs() -> dict[tuple[str, str], dict[str, Any]]:
    """``(kind, name)`` → resource, over every manifest."""
    out = {}
    for name in MANIFESTS:
        for doc in _load_all(K8S / name):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def _validate(doc: dict[str, Any], version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason=f"kubernetes-validate not installed ({TEST_EXTRA})")
    kv.validate(doc, version, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kust["resources"]) == sorted(on_disk) == sorted(MANIFESTS)
    images = {i["name"] for i in kust.get("images", [])}
    used = {c["image"].split(":")[0] for d in _k8s_docs().values() if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"]["containers"]}
    assert used == images == {"p2pkv-gpu"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_validates_against_the_kubernetes_schema(name: str, version: str) -> None:
    docs = _load_all(K8S / name)
    assert docs
    for doc in docs:
        _validate(doc, version)


def _mutations() -> list[tuple[str, Any]]:
    def replicas_word(d: dict[str, Any]) -> None:
        d["spec"]["replicas"] = "two"

    def misspelled_probe(d: dict[str, Any]) -> None:
        c = d["spec"]["template"]["spec"]["containers"][0]
        c["readinessprobe"] = c.pop("readinessProbe")

    def no_selector(d: dict[str, Any]) -> None:
        del d["spec"]["selector"]

    def port_as_word(d: dict[str, Any]) -> None:
        d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"

    return [("replicas: two", replicas_word), ("readinessprobe", misspelled_probe),
            ("no selector", no_selector), ("containerPort: http", port_as_word)]


@pytest.mark.parametrize(("label", "mutate"), _mutations(), ids=[m[0] for m in _mutations()])
def test_kubernetes_schema_rejects_a_broken_deployment(label: str, mutate: Any) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason=f"kubernetes-validate not installed ({TEST_EXTRA})")
    doc = copy.deepcopy(_k8s_docs()[("Deployment", "p2pkv-prefill")])
    _validate(doc, K8S_VERSIONS[0])  # the original passes
    mutate(doc)
    with pytest.raises(kv.ValidationError):
        _validate(doc, K8S_VERSIONS[0])


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _named_port(container: dict[str, Any], name: str) -> int | None:
    return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == name), None)


def _probe_problems(container: dict[str, Any], kinds: tuple[str, ...], path: str = "/health") -> list[str]:
    problems = []
    for kind in kinds:
        get = container.get(kind, {}).get("httpGet", {})
        port = get.get("port")
        number = _named_port(container, port) if isinstance(port, str) else port
        if get.get("path") != path or number is None:
            problems.append(f"{kind}: not an HTTP GET of {path} on a container port")
    return problems


def _scrape_problems(deployment: dict[str, Any], port: int) -> list[str]:
    ann = deployment["spec"]["template"]["metadata"].get("annotations", {})
    want = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    return [f"annotation {k}={ann.get(k)!r}, expected {v!r}" for k, v in want.items() if ann.get(k) != v]


def _service_problems(service: dict[str, Any], deployment: dict[str, Any]) -> list[str]:
    problems = []
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    if any(labels.get(k) != v for k, v in selector.items()):
        problems.append(f"service {service['metadata']['name']}: selector {selector} misses the pods")
    container = _container(deployment)
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        number = _named_port(container, target) if isinstance(target, str) else target
        if number is None:
            problems.append(f"service {service['metadata']['name']}: targetPort {target} is no container port")
    return problems


def engine_problems(docs: dict[tuple[str, str], dict[str, Any]], role: str) -> list[str]:
    """What the ``role`` engine's Deployment and Service lack (empty: nothing)."""
    dep = docs[("Deployment", f"p2pkv-{role}")]
    c = _container(dep)
    problems = []
    try:
        ns = parse_p2pkv(list(c.get("command", [])[1:] or c["args"]))
    except ValueError as exc:
        return [str(exc)]
    if (ns.command, getattr(ns, "mode", None)) != ("launch", role):
        problems.append(f"args are not `p2pkv launch {role}`")
        return problems
    if ns.port != ENGINE_PORTS[role] or _named_port(c, "http") != ns.port:
        problems.append(f"--port {ns.port} is not the container's http port {_named_port(c, 'http')}")
    if ns.side_channel_host != "$(POD_IP)":
        problems.append(f"--side-channel-host {ns.side_channel_host!r}: expected $(POD_IP)")
    if _named_port(c, "side-channel") != ns.side_channel_port:
        problems.append("--side-channel-port is not the container's side-channel port")
    env = {e["name"]: e for e in c.get("env", [])}
    if env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "status.podIP":
        problems.append("POD_IP does not come from status.podIP")
    for key in ("nvidia.com/gpu", RDMA_RESOURCE):
        if not c.get("resources", {}).get("limits", {}).get(key):
            problems.append(f"no {key} in resources.limits")
    if "IPC_LOCK" not in c.get("securityContext", {}).get("capabilities", {}).get("add", []):
        problems.append("no IPC_LOCK capability")
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes", [])}
    shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if not shm or volumes.get(shm[0]["name"], {}).get("emptyDir", {}).get("medium") != "Memory":
        problems.append("/dev/shm is not a memory-backed emptyDir")
    problems += _probe_problems(c, ("readinessProbe", "livenessProbe"))
    problems += _scrape_problems(dep, ns.port)
    problems += _service_problems(docs[("Service", f"p2pkv-{role}")], dep)
    return problems


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_deployment(role: str) -> None:
    _require_launch_role(role)
    docs = _k8s_docs()
    assert engine_problems(docs, role) == []
    svc = docs[("Service", f"p2pkv-{role}")]
    assert svc["spec"]["type"] == "ClusterIP"
    if role == "prefill":
        ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        assert ports == {"http": 8100, "side-channel": 5600}
        headless = docs[("Service", "p2pkv-prefill-pods")]
        assert headless["spec"]["clusterIP"] == "None"
        assert _service_problems(headless, docs[("Deployment", "p2pkv-prefill")]) == []


def _drop_ipc_lock(c: dict[str, Any]) -> None:
    c["securityContext"]["capabilities"]["add"] = []


def _drop_rdma(c: dict[str, Any]) -> None:
    del c["resources"]["limits"][RDMA_RESOURCE]


def _loopback_side_channel(c: dict[str, Any]) -> None:
    c["args"][c["args"].index("$(POD_IP)")] = "127.0.0.1"


def _probe_elsewhere(c: dict[str, Any]) -> None:
    c["livenessProbe"]["httpGet"]["path"] = "/"


def _port_mismatch(c: dict[str, Any]) -> None:
    c["ports"][0]["containerPort"] = 9000


@pytest.mark.parametrize(("mutate", "problem"), [
    (_drop_ipc_lock, "no IPC_LOCK"), (_drop_rdma, f"no {RDMA_RESOURCE}"),
    (_loopback_side_channel, "--side-channel-host"), (_probe_elsewhere, "livenessProbe"),
    (_port_mismatch, "--port 8100 is not"),
])
def test_engine_check_rejects_a_weakened_deployment(mutate: Any, problem: str) -> None:
    _require_launch_role("prefill")
    docs = copy.deepcopy(_k8s_docs())
    mutate(_container(docs[("Deployment", "p2pkv-prefill")]))
    problems = engine_problems(docs, "prefill")
    assert any(p.startswith(problem) for p in problems), problems


def test_decode_deployment_does_not_point_at_prefill() -> None:
    dep = _k8s_docs()[("Deployment", "p2pkv-decode")]
    text = json.dumps(dep["spec"])
    assert "prefill" not in text
    assert "prefill" in json.dumps(_k8s_docs()[("Deployment", "p2pkv-prefill")]["spec"])  # the check can see it


def test_proxy_addresses_the_engine_services() -> None:
    docs = _k8s_docs()
    dep = docs[("Deployment", "p2pkv-proxy")]
    c = _container(dep)
    ns = parse_p2pkv(c["args"])
    assert ns.command == "proxy" and ns.host == "0.0.0.0" and ns.port == _named_port(c, "http") == 8000
    for role in ("prefill", "decode"):
        svc = docs[("Service", f"p2pkv-{role}")]
        http = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
        assert [_host_port(v) for v in getattr(ns, role)] == [(svc["metadata"]["name"], http)]
    assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))
    assert _probe_problems(c, ("readinessProbe",)) == []
    assert _scrape_problems(dep, 8000) == []
    svc = docs[("Service", "p2pkv-proxy")]
    assert svc["spec"]["type"] == "ClusterIP"
    assert _service_problems(svc, dep) == []
    broken = copy.deepcopy(svc)
    broken["spec"]["selector"]["app.kubernetes.io/component"] = "proxi"
    assert _service_problems(broken, dep)


# --------------------------------------------------------------------------- GitHub workflows


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


def _p2pkv_invocations(lines: list[str]) -> list[list[str]]:
    out = []
    for line in lines:
        words = shlex.split(line.split("|")[0])
        for i, word in enumerate(words):
            if word == "p2pkv" or word.endswith("/p2pkv"):
                out.append(words[i + 1:])
    return out


@pytest.mark.parametrize("name", ["ci.yml", "gpu-ib.yml"])
def test_workflow_matches_the_github_workflow_schema(name: str) -> None:
    for schema in ("vendor.github-workflows", "custom.github-workflows-require-timeout"):
        result = _check_jsonschema(schema, WORKFLOWS / name)
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
    assert _check_jsonschema(schema, path).returncode != 0


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
    assert {("bench", "transfer"), ("demo", None), ("doctor", None)} <= kinds
    benches: dict[str, tuple[dict[str, Any], argparse.Namespace]] = {}
    for job in wf["jobs"].values():
        for argv in _p2pkv_invocations(_run_lines({"jobs": {"job": job}})):
            ns = parse_p2pkv(argv)
            if (ns.command, getattr(ns, "bench_command", None)) == ("bench", "transfer"):
                assert ns.device == "cuda"
                benches[ns.role] = (job, ns)
    assert set(benches) == {"both", "prefill", "decode"}
    # One node: side channel on the runner's IB address, results uploaded.
    job, bench = benches["both"]
    assert bench.host.startswith("$") and bench.json and bench.json in _uploads(job)
    # Two nodes: one job per role, concurrent, on two runners told apart by a label each;
    # the decode side finds the prefill through a repository variable.
    (prefill_job, prefill), (decode_job, decode) = benches["prefill"], benches["decode"]
    assert set(prefill_job["runs-on"]) - set(decode_job["runs-on"])
    assert set(decode_job["runs-on"]) - set(prefill_job["runs-on"])
    assert "needs" not in prefill_job and "needs" not in decode_job  # concurrent: neither waits for the other
    assert prefill.host.startswith("$") and not prefill.peer and prefill.serve_seconds > 0
    assert decode.peer == "$P2PKV_PREFILL_IB_HOST" and "vars.P2PKV_PREFILL_IB_HOST" in str(wf["env"])
    assert (prefill.port, prefill.control_port) == (decode.port, decode.control_port)
    assert decode.json and decode.json in _uploads(decode_job) and decode.plot in _uploads(decode_job)
    waits = " ".join(_run_lines({"jobs": {"decode": decode_job}}))
    assert f"$P2PKV_PREFILL_IB_HOST/{decode.control_port or decode.port + 2}" in waits
    # Only scripts that exist.
    for path in re.findall(r"(?:scripts|\.ci)/[\w./-]+", " ".join(lines)):
        assert (ROOT / path).exists(), f"{path} does not exist"


# --------------------------------------------------------------------------- Grafana dashboard

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label matchers, grouping labels, functions, ranges dropped)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)                      # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)                     # range / subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def _dashboard_exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "expr" and isinstance(v, str)] + \
            [e for k, v in node.items() if k != "expr" for e in _dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _dashboard_exprs(v)]
    return []


def engine_metric_definitions() -> dict[str, str]:
    """``name`` → ``counter|histogram|gauge`` as defined in p2pkv/metrics.py (read from its source)."""
    tree = ast.parse((ROOT / "p2pkv" / "metrics.py").read_text())
    kinds = {"_counter_cls": "counter", "_histogram_cls": "histogram", "_gauge_cls": "gauge"}
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in kinds:
            name = next(k.value for k in node.keywords if k.arg == "name")
            assert isinstance(name, ast.Constant) and isinstance(name.value, str)
            out[name.value] = kinds[node.func.attr]
    return out


def proxy_metric_definitions() -> dict[str, str]:
    """``name`` → type, from a live :class:`p2pkv.proxy.metrics.ProxyMetrics` registry."""
    from p2pkv.proxy.metrics import ProxyMetrics

    return {family.name: family.type for family in ProxyMetrics().registry.collect()}


def series_names(definitions: dict[str, str]) -> set[str]:
    """The series names Prometheus scrapes for these metric definitions."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {name.removesuffix("_total") + s for name, kind in definitions.items() for s in suffixes[kind]}


def unknown_dashboard_metrics(dashboard: dict[str, Any], known: set[str]) -> set[str]:
    """Metric names the dashboard's queries select that no p2pkv definition produces."""
    return {n for e in _dashboard_exprs(dashboard) for n in promql_metric_names(e)} - known


@functools.cache
def _known_series() -> frozenset[str]:
    return frozenset(series_names(engine_metric_definitions()) | series_names(proxy_metric_definitions()))


def test_promql_metric_name_extraction() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(p2pkv:pull_seconds_bucket{job="x"}[$__rate_interval])))'
    ) == {"p2pkv:pull_seconds_bucket"}
    assert promql_metric_names(
        "sum(rate(a_sum[5m])) / sum without (engine) (rate(a_count[5m])) * on (instance) group_left b"
    ) == {"a_sum", "a_count", "b"}
    assert promql_metric_names('count(up{kind="p2pkv:x"} offset 5m) > bool 0') == {"up"}


def test_metric_definitions_are_read_from_the_code() -> None:
    engine = engine_metric_definitions()
    assert engine["p2pkv:pull_seconds"] == "histogram" and engine["p2pkv:pull_failures"] == "counter"
    assert len(engine) >= 8
    proxy = proxy_metric_definitions()
    assert proxy["p2pkv_proxy_requests"] == "counter" and proxy["p2pkv_proxy_overhead_seconds"] == "histogram"
    known = _known_series()
    assert {"p2pkv:pull_bytes_total", "p2pkv:pull_seconds_bucket", "p2pkv_proxy_requests_total"} <= known
    assert "p2pkv:pull_bytes" not in known and "p2pkv:pulls_bucket" not in known


def test_engine_metric_names_match_what_the_engine_exposes() -> None:
    """The names read from p2pkv/metrics.py are the series a real P2pKvPromMetrics exposes."""
    from types import SimpleNamespace

    try:
        from p2pkv.metrics import P2pKvPromMetrics
    except ImportError as exc:
        pytest.skip(f"vLLM is not importable here ({exc}); the source-read names are checked elsewhere")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = P2pKvPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                            {0: ["model", "0"]})
    prom.observe({"pull_bytes": [4096], "pull_seconds": [0.002], "pull_descriptors": [4],
                  "handshake_seconds": [0.01], "leases_expired": 1, "leases_notified": 2,
                  "failures": {"timeout": 1}})
    exposed = {s.name for fam in reg.collect() for s in fam.samples if not s.name.endswith("_created")}
    assert exposed == series_names(engine_metric_definitions())
    labels = {tuple(sorted(s.labels)) for fam in reg.collect() for s in fam.samples if s.name.endswith("_total")}
    assert ("engine", "kind", "model_name") in labels


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    titles = {p["title"] for p in panels}
    for wanted in ("KV pull throughput", "KV pulls per second", "KV pull latency", "NIXL descriptors per pull",
                   "Handshake time", "KV pull failures by kind", "Held prefill requests released",
                   "Proxy requests by status", "Proxy latency", "Proxy overhead"):
        assert wanted in titles
    exprs = " ".join(_dashboard_exprs(dash))
    for q in ("histogram_quantile(0.5, sum by (le) (rate(p2pkv:pull_seconds_bucket",
              "histogram_quantile(0.99, sum by (le) (rate(p2pkv:pull_seconds_bucket",
              "histogram_quantile(0.5, sum by (le) (rate(p2pkv_proxy_overhead_seconds_bucket",
              "sum by (kind) (rate(p2pkv:pull_failures_total", "sum by (endpoint, status) (rate("):
        assert q in exprs, q


def test_dashboard_queries_only_metrics_p2pkv_defines() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert unknown_dashboard_metrics(dash, set(_known_series())) == set()
    # Every metric p2pkv defines has a panel.
    used = {n for e in _dashboard_exprs(dash) for n in promql_metric_names(e)}
    for name in {**engine_metric_definitions(), **proxy_metric_definitions()}:
        assert any(u.startswith(name.removesuffix("_total")) for u in used), f"{name}: no panel"


@pytest.mark.parametrize(("old", "new"), [
    ("p2pkv:pull_bytes_total", "p2pkv:pulled_bytes_total"),   # a renamed metric
    ("p2pkv:pulls_total", "p2pkv:pulls_bucket"),               # a counter read as a histogram
    ("p2pkv_proxy_overhead_seconds_bucket", "p2pkv_proxy_overhead_bucket"),
])
def test_dashboard_check_rejects_unknown_metrics(old: str, new: str) -> None:
    text = DASHBOARD.read_text()
    assert old in text
    dash = json.loads(text.replace(old, new))
    assert unknown_dashboard_metrics(dash, set(_known_series())) == {new}
