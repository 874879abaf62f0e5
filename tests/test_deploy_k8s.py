"""Kubernetes manifests: validated against Kubernetes' OpenAPI schemas, and checked for what P/D pods need.

Each check has a negative control showing it can fail.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from tests import deploy_support
from tests.deploy_support import (
    ENGINE_PORTS,
    K8S,
    K8S_VERSIONS,
    MANIFESTS,
    RDMA_RESOURCE,
    TEST_EXTRA,
    host_port,
    load_all,
    parse_p2pkv,
    require_launch_role,
)


def test_a_missing_launch_subcommand_fails_rather_than_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifests and compose file run ``p2pkv launch prefill|decode``: a subcommand gone missing must
    fail the tests that parse them, naming it. Before: they were skipped, hiding the regression."""
    monkeypatch.setattr(deploy_support, "launch_roles", lambda: {"prefill"})
    require_launch_role("prefill")
    with pytest.raises(BaseException) as info:  # a skip is caught too: it must fail the test
        require_launch_role("decode")
    assert info.type is pytest.fail.Exception, f"{info.type.__name__}: {info.value}"
    assert "p2pkv launch decode" in str(info.value)


def _k8s_docs() -> dict[tuple[str, str], dict[str, Any]]:
    """``(kind, name)`` → resource, over every manifest."""
    out = {}
    for name in MANIFESTS:
        for doc in load_all(K8S / name):
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
    docs = load_all(K8S / name)
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
    require_launch_role(role)
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
    require_launch_role("prefill")
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
        assert [host_port(v) for v in getattr(ns, role)] == [(svc["metadata"]["name"], http)]
    assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))
    # the proxy exits 2 without the side-channel secret: the same Secret as the engines'
    secrets = [{e["name"]: e for e in _container(docs[("Deployment", f"p2pkv-{name}")]).get("env", [])}
               .get("P2PKV_SECRET", {}).get("valueFrom") for name in ("proxy", "prefill", "decode")]
    assert secrets[0] == secrets[1] == secrets[2] == {"secretKeyRef": {"name": "p2pkv-side-channel", "key": "secret"}}
    assert not ns.insecure
    assert _probe_problems(c, ("readinessProbe",)) == []
    assert _scrape_problems(dep, 8000) == []
    svc = docs[("Service", "p2pkv-proxy")]
    assert svc["spec"]["type"] == "ClusterIP"
    assert _service_problems(svc, dep) == []
    broken = copy.deepcopy(svc)
    broken["spec"]["selector"]["app.kubernetes.io/component"] = "proxi"
    assert _service_problems(broken, dep)


# ---- NetworkPolicy: who may connect to the engine pods ---------------------------------------------------------

EPHEMERAL = 40000
"""A port UCX might pick for a connection between the engines."""


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector selects a pod with ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _pod_labels(docs: dict[tuple[str, str], dict[str, Any]], component: str) -> dict[str, str]:
    return docs[("Deployment", f"p2pkv-{component}")]["spec"]["template"]["metadata"]["labels"]


def _admits(policy: dict[str, Any], source: dict[str, str], port: int) -> bool:
    """Whether ``policy``'s ingress rules let a pod of this namespace with labels ``source`` reach TCP ``port``
    (a peer other than a pod selector is taken to admit everyone)."""
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        if peers and not any(set(p) != {"podSelector"} or _selects(p["podSelector"], source) for p in peers):
            continue
        ports = rule.get("ports")
        if not ports or any(p.get("protocol", "TCP") == "TCP" and
                            ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"])) for p in ports):
            return True
    return False


def policy_problems(docs: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """What the NetworkPolicies get wrong about who reaches the pods (empty: nothing)."""
    engines, proxy = docs[("NetworkPolicy", "p2pkv-engines")], docs[("NetworkPolicy", "p2pkv-proxy")]
    labels = {c: _pod_labels(docs, c) for c in ("prefill", "decode", "proxy")}
    port = {c: _named_port(_container(docs[("Deployment", f"p2pkv-{c}")]), "http") for c in labels}
    side = _named_port(_container(docs[("Deployment", "p2pkv-prefill")]), "side-channel")
    problems = []
    for role in ("prefill", "decode"):
        if not _selects(engines["spec"]["podSelector"], labels[role]):
            problems.append(f"p2pkv-engines: podSelector misses the {role} pods")
    if _selects(engines["spec"]["podSelector"], labels["proxy"]) or \
            not _selects(proxy["spec"]["podSelector"], labels["proxy"]):
        problems.append("podSelectors: p2pkv-proxy must select the proxy pods, p2pkv-engines not")
    for policy in (engines, proxy):
        if policy["spec"].get("policyTypes") != ["Ingress"]:
            problems.append(f"{policy['metadata']['name']}: policyTypes is not [Ingress]")
    wanted = [("proxy", role, port[role]) for role in ("prefill", "decode")] + [("proxy", "prefill", side)]
    wanted += [(a, b, p) for a, b in (("decode", "prefill"), ("prefill", "decode")) for p in (side, EPHEMERAL)]
    for source, role, p in wanted:
        if not _admits(engines, labels[source], p):
            problems.append(f"p2pkv-engines: {source} -> {role} port {p} refused")
    other = {"app.kubernetes.io/name": "something-else"}
    for source, p in (("other", port["prefill"]), ("other", side), ("other", EPHEMERAL), ("proxy", EPHEMERAL)):
        if _admits(engines, other if source == "other" else labels[source], p):
            problems.append(f"p2pkv-engines: {source} pods reach the engines' port {p}")
    if not _admits(proxy, other, port["proxy"]):
        problems.append("p2pkv-proxy: clients cannot reach the proxy's HTTP port")
    return problems


def test_network_policy_lets_only_the_proxy_and_the_engines_in() -> None:
    docs = _k8s_docs()
    assert policy_problems(docs) == []


def _prefill_only(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    docs[("NetworkPolicy", "p2pkv-engines")]["spec"]["podSelector"]["matchExpressions"][0]["values"] = ["prefill"]


def _relabelled_decode(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    _pod_labels(docs, "decode")["app.kubernetes.io/component"] = "decoder"


def _side_channel_only(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    docs[("NetworkPolicy", "p2pkv-engines")]["spec"]["ingress"][1]["ports"] = [{"protocol": "TCP", "port": 5600}]


def _open_to_all(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    docs[("NetworkPolicy", "p2pkv-engines")]["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 8100}]})


@pytest.mark.parametrize(("mutate", "problem"), [
    (_prefill_only, "p2pkv-engines: podSelector misses the decode pods"),
    (_relabelled_decode, "p2pkv-engines: podSelector misses the decode pods"),
    (_side_channel_only, f"p2pkv-engines: decode -> prefill port {EPHEMERAL} refused"),
    (_open_to_all, "p2pkv-engines: other pods reach the engines' port 8100"),
])
def test_network_policy_check_rejects_a_wrong_policy(mutate: Any, problem: str) -> None:
    docs = copy.deepcopy(_k8s_docs())
    mutate(docs)
    assert problem in policy_problems(docs)
