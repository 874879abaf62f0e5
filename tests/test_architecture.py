"""The import rules of docs/architecture.md, read off the source: no cycles, layers point one way."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = {"p2pkv.config", "p2pkv.params", "p2pkv.metadata", "p2pkv.notification", "p2pkv.grant",
             "p2pkv.lifetime", "p2pkv.bindings"}
SIDES = {"p2pkv.connector", "p2pkv.compat", "p2pkv.plugin", "p2pkv.scheduler", "p2pkv.worker"}
VLLM_ALLOWED = {"p2pkv.connector", "p2pkv.compat", "p2pkv.plugin", "p2pkv.scheduler", "p2pkv.telemetry.metrics"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module → every module it imports (any scope, TYPE_CHECKING included), for p2pkv and handshake."""
    graph: dict[str, set[str]] = {}
    for pkg in ("p2pkv", "handshake"):
        for path in (ROOT / pkg).rglob("*.py"):
            targets: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    targets |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets.add(node.module)
                    targets |= {f"{node.module}.{a.name}" for a in node.names}
            graph[_module_name(path)] = targets
    known = set(graph)
    return {m: {t for t in ts if t in known or t.split(".")[0] in ("vllm", "tests")} for m, ts in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "p2pkv.decode.receiver" in graph["p2pkv.worker"]
    assert "p2pkv.dataplane.agent" in graph["p2pkv.decode.receiver"]


def test_no_import_cycles() -> None:
    assert _cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_point_one_way() -> None:
    bad = []
    for mod, targets in import_graph().items():
        for t in targets:
            if t.startswith("tests"):
                bad.append(f"{mod} imports test code {t}")
            elif mod.startswith("handshake") and t.startswith("p2pkv"):
                bad.append(f"{mod} (side channel) imports {t}")
            elif not mod.startswith("p2pkv.tools") and t.startswith("p2pkv.tools"):
                bad.append(f"{mod} imports the operator tool {t}")
            elif mod.split(".")[1:2] in (["decode"], ["prefill"], ["dataplane"], ["telemetry"]) and t in SIDES:
                bad.append(f"{mod} imports the vLLM-facing {t}")
            elif mod.startswith("p2pkv.dataplane") and t.startswith(("p2pkv.decode", "p2pkv.prefill")):
                bad.append(f"{mod} (data plane) imports {t}")
            elif mod in CONTRACTS and t.startswith("p2pkv") and t not in CONTRACTS:
                bad.append(f"{mod} (a contract) imports {t}")
            elif t.startswith("vllm") and not mod.startswith("p2pkv.tools") and mod not in VLLM_ALLOWED:
                bad.append(f"{mod} imports vLLM ({t}); only {sorted(VLLM_ALLOWED)} may")
    assert bad == []


def test_every_internal_import_resolves() -> None:
    """Imports inside functions (lazy ones too) name modules and names that exist."""
    import importlib
    import importlib.util

    missing = []
    for pkg in ("p2pkv", "handshake"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] in ("p2pkv", "handshake")):
                    continue
                try:
                    module = importlib.import_module(node.module)
                except ImportError as exc:
                    missing.append(f"{path}: {node.module} ({exc})")
                    continue
                for alias in node.names:
                    if not hasattr(module, alias.name) and importlib.util.find_spec(
                            f"{node.module}.{alias.name}") is None:
                        missing.append(f"{path}: {node.module}.{alias.name}")
    assert missing == []
