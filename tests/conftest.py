"""Shared fixtures: the tiny model, free ports, CUDA detection for GPU tests, the engine tests' shared pair, and
the worker tests' prefill process and decode workers (:mod:`tests.p2p_harness`)."""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.p2p_harness import DecodeSide, PrefillProc

os.environ.setdefault("UCX_NET_DEVICES", "lo")


ENGINE_MODULES = frozenset({
    "tests/test_bench_serve.py", "tests/test_e2e.py", "tests/test_e2e_faults.py", "tests/test_e2e_first_token.py",
    "tests/test_e2e_models.py", "tests/test_e2e_pipeline.py", "tests/test_e2e_stream.py", "tests/test_e2e_tracing.py",
    "tests/test_hostile.py", "tests/test_launch.py",
})
"""Test modules with tests that start or use real engines (marked ``engines``): under pytest-xdist they all run
in one worker, which starts the session's engines once (:func:`pytest_xdist_make_scheduler`)."""

ENGINE_FIXTURES = frozenset({"launched", "kind_pair"})
"""Fixtures that start engines: a test that uses one (directly or through another fixture) must be marked
``engines``."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's load-scope scheduling with one scope for :data:`ENGINE_MODULES` and one per test elsewhere.

    (xdist's own ``loadgroup`` marks do not reach pytest 9's node ids.)
    """
    from xdist.scheduler import LoadScopeScheduling

    class EngineModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "engines" if nodeid.split("::")[0] in ENGINE_MODULES else nodeid

    return EngineModulesTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``engines`` outside :data:`ENGINE_MODULES` is a usage error (under xdist it would start a
    second copy of the session's engines in another worker); GPU tests are skipped without a CUDA device."""
    stray = sorted({i.nodeid.split("::")[0] for i in items if "engines" in i.keywords} - ENGINE_MODULES)
    if stray:
        raise pytest.UsageError(f"{', '.join(stray)} start engines: add them to ENGINE_MODULES in tests/conftest.py")
    unmarked = sorted(i.nodeid for i in items if "engines" not in i.keywords
                      and not ENGINE_FIXTURES.isdisjoint(getattr(i, "fixturenames", ())))
    if unmarked:  # scripts/test.sh runs them with the in-process tests, several at once: engines would start twice
        raise pytest.UsageError(f"{', '.join(unmarked[:5])} use engines: mark them pytest.mark.engines")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama model directory (made once per session)."""
    from p2pkv.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=32)
"""The last base ports :func:`free_ports` handed out in this test process (older ones are bound or given up):
each keeps about 45 ports from being handed out, so a few thousand ports per process leave plenty."""


def port_range() -> tuple[int, int]:
    """``[low, high)``: this test process's share of the ports 20000-31999 (below the kernel's ephemeral range).

    ``P2PKV_TEST_PORTS`` (``"low-high"``) narrows that for a whole pytest run (scripts/test.sh gives the
    in-process and the engine run halves of their own); under pytest-xdist each worker (``PYTEST_XDIST_WORKER``
    ``gw<i>`` of ``PYTEST_XDIST_WORKER_COUNT``) then gets its own slice, so two test processes never hand out
    the same port before either has bound it.
    """
    low, high = (int(p) for p in os.environ.get("P2PKV_TEST_PORTS", "20000-32000").split("-"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    span = (high - low) // count // 8 * 8
    return low + index * span, low + (index + 1) * span


def free_ports(n: int, run: int = 2) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now, each followed by ``run - 1`` free ports.

    Chosen below the kernel's ephemeral range (32768-60999), where engines
    starting up take random ports for themselves, so a port handed out here
    is not taken by the time the process that needs it binds it; ``run``
    leaves room for the side channel of TP ranks (port + tp_rank).

    No port of the last 32 runs handed out in this test process is handed
    out again, nor one 100 above or below them (``LocalPair`` puts the decode side
    channel at ``side_channel_port + 100``): fixtures often pick ports for
    several engines before any of them binds, and vLLM's API server binds
    with ``SO_REUSEPORT``, so two engines given the same port would both
    start and share its connections.

    Raises:
        RuntimeError: no such run found in 10,000 tries (this process's port range is too narrow).
    """
    rng = random.Random()
    low, high = port_range()
    chosen: list[int] = []
    for _ in range(10_000):
        if len(chosen) == n:
            return chosen
        base = rng.randrange(low, high, 8)
        if any(abs(base + shift - c) < 8 for c in _HANDED_OUT for shift in (-100, 0, 100)):
            continue
        try:
            for port in range(base, base + run):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        chosen.append(base)
        _HANDED_OUT.append(base)
    if len(chosen) == n:
        return chosen
    raise RuntimeError(f"no {n} free runs of {run} ports in [{low}, {high}) after 10,000 tries")


BLOCK = 32
"""Tokens per block of the shared engine pair."""
MAX_BATCHED_TOKENS = 256
"""Tokens the session's engines compute per step (``--max-num-batched-tokens``): a longer prompt's prefill runs
in chunks (vLLM's chunked prefill), as on a busy production engine."""


@pytest.fixture(scope="session")
def otlp():
    """A session-wide OTLP/HTTP span receiver on 127.0.0.1 (:class:`p2pkv.tools.trace.otlp_receiver.OtlpReceiver`):
    the shared pair's proxy and engines export every span to it."""
    from p2pkv.tools.trace.otlp_receiver import OtlpReceiver

    with OtlpReceiver("127.0.0.1", 0) as receiver:
        yield receiver


@dataclasses.dataclass
class Launched:
    """The shared pair as ``p2pkv launch local`` started it.

    Attributes:
        pair: the pair's settings (a :class:`p2pkv.tools.deploy.local.LocalPair` the launcher process runs;
            its URLs, secret and log folder).
        stats: the decode engine's pull stats file (JSONL).
        proc: the launcher process.
        lines: what the launcher printed so far (stdout and stderr).
    """

    pair: Any
    stats: Path
    proc: Any
    lines: list[str]


@pytest.fixture(scope="session")
def launched(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, otlp) -> Launched:
    """One P/D pair behind the proxy plus an aggregated engine, started by ``p2pkv launch local`` (so the
    launcher runs as users run it) and shared by the engine tests; its spans go to :func:`otlp`.

    The decode engine gives up a handshake (and a fence question) after 3 s; the prefill engine writes its own
    pull stats (when a test sends it a decode leg) to ``prefill.jsonl`` beside. At the end of
    the session the launcher gets SIGTERM and must stop everything and exit 0 (a teardown error otherwise).
    """
    import json
    import signal
    import subprocess
    import sys
    import threading
    import time

    from p2pkv.tools.deploy.local import LocalPair

    logs = tmp_path_factory.mktemp("logs")
    proxy, prefill, decode, agg, side = free_ports(5)
    stats = logs / "pulls.jsonl"
    # short test prompts stream, and layer by layer on a link as fast against the forward as cma is here
    extra = {"stats_file": str(logs / "prefill.jsonl"), "stream_min_tokens": 0}
    # every load verified (no false mismatch under every request shape); FAULTS corrupt only requests aimed at
    decode_extra = {"stats_file": str(stats), "handshake_timeout_s": 3.0, "verify_kv": True}
    pair = LocalPair(model=str(tiny_model), proxy_port=proxy, prefill_port=prefill, decode_port=decode,
                     aggregated_port=agg, side_channel_port=side, block_size=BLOCK, log_dir=logs,
                     extra_config=extra, decode_extra_config=decode_extra, max_model_len=1024,
                     otlp_traces_endpoint=otlp.url,
                     engine_args=("--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)))
    argv = [sys.executable, "-m", "p2pkv.tools.cli", "launch", "local", "--model", str(tiny_model),
            "--proxy-port", str(proxy), "--prefill-port", str(prefill), "--decode-port", str(decode),
            "--aggregated-port", str(agg), "--side-channel-port", str(side), "--block-size", str(BLOCK),
            "--max-model-len", "1024", "--log-dir", str(logs), "--kv-connector-extra-config", json.dumps(extra),
            "--decode-extra-config", json.dumps(decode_extra), "--otlp-traces-endpoint", otlp.url,
            "--extra-vllm-args", f"--max-num-batched-tokens {MAX_BATCHED_TOKENS}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **FAULTS, "P2PKV_SECRET": pair.secret})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 900
        while not any(x.startswith("ready:") for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        yield Launched(pair, stats, proc, lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "p2pkv launch local did not stop cleanly:\n" + "".join(lines[-40:])
    finally:
        if proc.poll() is None:  # the launcher stops its engines on SIGTERM; SIGKILL would leave them running
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def pair(launched: Launched):
    """``(LocalPair, pull stats file)`` of the shared pair (:func:`launched`)."""
    return launched.pair, launched.stats


@pytest.fixture(scope="session")
def client():
    """An HTTP client (120 s timeout) for the tests that talk HTTP to engines, real or fake, and proxies."""
    import httpx

    with httpx.Client(timeout=120.0) as c:
        yield c


FAULT_MARK = "p2pkv-fault"
"""What a test puts in a decode leg's ``X-Request-Id`` to have its KV corrupted as it lands (:data:`FAULTS`)."""
FAULTS = {"P2PKV_ALLOW_FAULTS": "1", "P2PKV_FAULT_CORRUPT_LANDED": "1", "P2PKV_FAULT_REQUESTS": FAULT_MARK}
"""The fault knobs (:mod:`p2pkv.faults`) of the suite's engines: the KV of a request whose id holds
:data:`FAULT_MARK` is overwritten as it lands; every other request is left alone."""

MODES = ("pull", "push")
"""The transfer directions every in-process suite runs in (``kv_transfer_params.p2pkv_transfer_mode``)."""
ROUTE_MODES = (*MODES, "stream")
"""The proxy's transfer modes the engine suites run in (``--transfer-mode``): a stream proxy sends both legs at
once and the prefill rank WRITEs each layer as it is computed."""


def start_mode_proxy(pair: Any, mode: str) -> tuple[str, Any]:
    """Start one more proxy in front of ``pair``'s engines whose decode legs ask for ``mode``
    (``--transfer-mode``); ``(its URL, its child process)``. A proxy starts in seconds: the engines are shared."""
    from p2pkv.tools.deploy.processes import start_child, wait_healthy

    (port,) = free_ports(1)
    routed = dataclasses.replace(pair, proxy_port=port, proxy_args=(*pair.proxy_args, "--transfer-mode", mode))
    child = start_child(f"proxy-{mode}", routed.proxy_command(), {**os.environ, "P2PKV_SECRET": pair.secret},
                        pair.log_dir, f"http://{pair.host}:{port}/health")
    wait_healthy([child], 60.0)
    return f"http://{pair.host}:{port}", child


@dataclasses.dataclass(frozen=True)
class Route:
    """A :class:`p2pkv.tools.deploy.local.LocalPair` as one transfer direction sees it: its own proxy, whose
    decode legs ask for ``mode``; the engines are the pair's.

    Attributes:
        pair: the engines.
        mode: ``"pull"``, ``"push"`` or ``"stream"``.
        proxy_url: the proxy for ``mode``.
    """

    pair: Any
    mode: str
    proxy_url: str

    def url(self, name: str) -> str:
        """``proxy``: this route's proxy; ``prefill``/``decode``/``aggregated``: the pair's engines."""
        return self.proxy_url if name == "proxy" else self.pair.url(name)

    def fresh(self, prompt: str) -> str:
        """``prompt`` as this route sends it: as is for pull, reversed for push (same length; a palindrome
        case-swapped), its first character replaced by ``#`` for stream (``%`` if it is one), so the engines'
        prefix caches from the other modes' runs hold none of its first block and every block moves again."""
        if self.mode == "pull":
            return prompt
        if self.mode == "stream":
            return ("%" if prompt.startswith("#") else "#") + prompt[1:]
        return prompt[::-1] if prompt[::-1] != prompt else prompt.swapcase()

    def params(self, params: dict) -> dict:
        """``kv_transfer_params`` a test sends straight to the decode engine, asking for this route's mode."""
        return {**params, "p2pkv_transfer_mode": self.mode}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pair, name)


@pytest.fixture(scope="session")
def routes(pair):
    """``{mode: Route}`` of the shared pair: its own proxy for each mode."""
    import httpx

    from p2pkv.tools.demo import complete
    from p2pkv.tools.deploy.processes import stop_children

    p, _ = pair
    started = {mode: start_mode_proxy(p, mode) for mode in ROUTE_MODES}
    try:
        routes = {mode: Route(p, mode, url) for mode, (url, _) in started.items()}
        with httpx.Client(timeout=120) as client:  # the stream proxy learns the prefill engine's address (pushed)
            complete(client, routes["stream"].url("proxy"), routes["stream"].fresh("where is the prefill engine"),
                     max_tokens=2)
        yield routes
    finally:
        stop_children([child for _, child in started.values()])


@pytest.fixture(params=ROUTE_MODES)
def route(request, pair, routes):
    """``(Route, pull stats file)``: the shared pair in each transfer mode of the proxy (tests run once per
    mode; ``@pytest.mark.parametrize("route", MODES, indirect=True)`` for a test that does not apply to
    streams)."""
    return routes[request.param], pair[1]


@pytest.fixture(scope="module")
def prefill(request: pytest.FixtureRequest) -> Iterator[PrefillProc]:
    """The module's prefill process (:class:`tests.p2p_harness.PrefillProc`, seed 1; its cache's layout the
    indirect parameter, ``BLHNC`` without one); at its end nothing was released twice or without a lease, and no
    hold stayed pinned by a WRITE."""
    from tests.p2p_harness import LAYOUT, PrefillProc, free_port

    pf = PrefillProc(free_port(), seed=1, num_blocks=64, lease_s=30.0, layout=getattr(request, "param", LAYOUT))
    pf.start()
    try:
        yield pf
    finally:
        pf.stop()
    twice = {r for r in pf.leased if pf.times_released(r) > 1}
    assert not twice, f"requests released more than once on the prefill side: {sorted(twice)}"
    assert not pf.released() - pf.leased, "released requests that were never leased"
    assert not pf.pinned_at_stop, f"holds still pinned by a WRITE at the end: {pf.pinned_at_stop}"


def _decode_side(request: pytest.FixtureRequest, **cfg: Any) -> Iterator[DecodeSide]:
    from tests.p2p_harness import DECODE_CFG, DecodeSide

    d = DecodeSide(64, **cfg, **getattr(request.module, "DECODE_CFG", DECODE_CFG))
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def decode(request: pytest.FixtureRequest) -> Iterator[DecodeSide]:
    """A decode worker (:class:`tests.p2p_harness.DecodeSide`, 64 blocks) in this process that pulls
    (``transfer_mode: pull``: under ``auto`` a probe READ would come first, and the fault tests count READs), set
    up with the test module's ``DECODE_CFG`` if it has one, else :data:`tests.p2p_harness.DECODE_CFG`."""
    yield from _decode_side(request, transfer_mode="pull")


@pytest.fixture(params=MODES)
def mode_decode(request: pytest.FixtureRequest) -> Iterator[DecodeSide]:
    """:func:`decode` in each transfer mode (pull: it READs; push: the prefill rank WRITEs; the test runs once per
    mode)."""
    yield from _decode_side(request, transfer_mode=request.param)


@pytest.fixture(scope="module")
def agents() -> Iterator[Any]:
    """The module's two NIXL agents in this process (:class:`tests.push_support.Agents`): a prefill agent with a
    KV cache, a decode agent with a zeroed one, both registered."""
    from tests.push_support import make_agents

    with make_agents() as made:
        yield made
