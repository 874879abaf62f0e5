"""The rules of docs/architecture.md, read off the source: no cycles, layers point one way, the module map lists
every module and nothing else, and each "may import" column names what its module imports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = {"p2pkv.config", "p2pkv.params", "p2pkv.prompt_digest", "p2pkv.metadata", "p2pkv.notification",
             "p2pkv.grant", "p2pkv.lifetime", "p2pkv.bindings", "p2pkv.ways"}
SIDES = {"p2pkv.connector", "p2pkv.engine_facts", "p2pkv.plugin", "p2pkv.scheduler", "p2pkv.worker"}
WORKER_FOLDERS = ("p2pkv.decode", "p2pkv.prefill", "p2pkv.dataplane")
"""What runs in vLLM's workers; ``p2pkv.scheduling`` runs in its scheduler, and neither imports the other."""
VLLM_ALLOWED = {"p2pkv.connector", "p2pkv.engine_facts", "p2pkv.plugin", "p2pkv.scheduler", "p2pkv.telemetry.metrics"}


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
            elif mod.split(".")[1:2] in (["decode"], ["prefill"], ["dataplane"], ["telemetry"], ["scheduling"]) \
                    and t in SIDES:
                bad.append(f"{mod} imports the vLLM-facing {t}")
            elif mod.startswith("p2pkv.scheduling") and t.startswith(WORKER_FOLDERS):
                bad.append(f"{mod} (the scheduler process) imports the workers' {t}")
            elif mod.startswith(WORKER_FOLDERS) and t.startswith("p2pkv.scheduling"):
                bad.append(f"{mod} (a worker) imports the scheduler process's {t}")
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


DOC = ROOT / "docs" / "architecture.md"


def _module_map() -> list[tuple[str, list[str], str | None]]:
    """docs/architecture.md's module map: (folder, the files a row's first cell names, its "may import" cell or None).

    A ``### `` heading's first code span names the folder (``p2pkv/decode/``); a table row's first cell names
    its files (``fixup.py``, ``fixup_triton.py``); the third cell, where the table has one, what they may import.
    """
    text = DOC.read_text()
    start = text.index("\n## Module map\n")
    end = text.index("\n## ", start + 1)
    rows: list[tuple[str, list[str], str | None]] = []
    folder = None
    for line in text[start:end].splitlines():
        if line.startswith("### "):
            spans = re.findall(r"`([^`]+)`", line)
            folder = spans[0] if spans and spans[0].endswith("/") else None
            assert folder is not None, f"docs/architecture.md: heading {line!r} names no folder in its first code span"
            continue
        if not line.startswith("|") or folder is None:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        files = re.findall(r"`([^`/]+\.py)`", cells[0])
        if files:
            rows.append((folder, files, cells[2] if len(cells) > 2 else None))
    return rows


def _tree() -> set[str]:
    """Every module file of p2pkv and handshake (repository-relative), packages' ``__init__.py`` left out."""
    return {path.relative_to(ROOT).as_posix() for pkg in ("p2pkv", "handshake") for path in (ROOT / pkg).rglob("*.py")
            if path.name != "__init__.py"}


def test_the_module_map_lists_every_module_and_nothing_else() -> None:
    listed = [folder + name for folder, files, _ in _module_map() for name in files]
    repeated = sorted({m for m in listed if listed.count(m) > 1})
    assert repeated == [], f"docs/architecture.md lists these modules more than once: {repeated}"
    missing = sorted(_tree() - set(listed))
    extra = sorted(set(listed) - _tree())
    assert (missing, extra) == ([], []), (f"docs/architecture.md's module map lacks {missing} "
                                          f"and lists modules that do not exist: {extra}")


def test_the_module_map_is_read() -> None:
    rows = {(folder, tuple(files)): cell for folder, files, cell in _module_map()}
    assert rows[("p2pkv/dataplane/", ("fixup.py", "fixup_triton.py"))].startswith("torch, triton")
    assert rows[("handshake/", ("codec.py",))] is not None
    assert rows[("p2pkv/tools/proxy/", ("app.py",))] is None  # the tools' tables have no "may import" column


def test_package_inits_hold_no_code_of_their_own() -> None:
    """What lets the module map leave ``__init__.py`` out: docstring, imports, ``__all__``, constants, and at
    most a module ``__getattr__`` (names imported on first use)."""
    bad = []
    for pkg in ("p2pkv", "handshake"):
        for path in (ROOT / pkg).rglob("__init__.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef | ast.AsyncFunctionDef) or (
                        isinstance(node, ast.FunctionDef) and node.name != "__getattr__"):
                    bad.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert bad == [], f"list these in docs/architecture.md's module map, or move them into a module: {bad}"


def _covers(name: str, target: str, package: str) -> bool:
    """Whether ``name`` in a "may import" cell (``decode.fence``, ``layout``, ``handshake``) covers ``target``."""
    if name == "handshake" and target.startswith("handshake"):
        return True
    return any(target == c or target.startswith(c + ".") for c in (name, f"p2pkv.{name}", f"{package}.{name}"))


def test_may_import_names_every_import() -> None:
    """Each "may import" cell names (itself, a package above it, or folder-relative) every p2pkv and handshake
    module its file imports; "everything in `p2pkv/`" and "the rest of `X`" cover what they say."""
    graph = import_graph()
    bad = []
    for folder, files, cell in _module_map():
        if cell is None:
            continue
        package = folder.rstrip("/").replace("/", ".")
        names = re.findall(r"`([a-z_][a-z_.]*)`", cell)
        names += re.findall(r"the rest of `([a-z_.]+)`", cell)
        for name in files:
            module = f"{package}.{name.removesuffix('.py')}"
            if "everything in `p2pkv/`" in cell:
                continue
            for target in sorted(graph[module]):
                if target.startswith(("vllm", "tests")) or target in (package, module) or target == "p2pkv":
                    continue
                if not any(_covers(n, target, package) for n in names):
                    bad.append(f"{folder}{name} imports {target}")
    assert bad == [], f"docs/architecture.md's \"may import\" column lacks: {bad}"
