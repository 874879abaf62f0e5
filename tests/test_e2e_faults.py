"""Faults in every way (pull, push, stream), through the proxy, on real engines.

A prefill engine of this module's own (the session's shared engines must live on) is SIGKILLed while a prompt
of every way is in flight, then started again on the same ports; a proxy is SIGKILLed mid-answer and another
started. The session's decode and aggregated engines serve beside it, one proxy per way in front of the pair.
For each fault: what the client gets (an answer equal to the aggregated engine's, or an error, never wrong
tokens), how long it took (recorded in ``faults.json`` beside the module's logs and in docs/reliability.md,
not asserted: timing belongs to measurements), and that nothing stays held past the prefill engine's lease.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from p2pkv.tools.demo import complete, kv_cache_usage
from p2pkv.tools.deploy.engines import EngineSpec, start_engine
from p2pkv.tools.deploy.processes import Child, start_child, stop_children, wait_healthy
from tests.conftest import BLOCK, MAX_BATCHED_TOKENS, free_ports

pytestmark = pytest.mark.engines

WAYS = ("pull", "push", "stream")
LEASE_S = 10.0
"""The module's prefill engine's ``lease_s``: the latest a hold its decode leg never ends may last."""
LONG = "A prefill engine that dies costs its clients seconds, not a minute. " * 12  # chunked: > 256 tokens
KILL_AFTER_S = 0.1
"""When the prefill engine is killed after the prompts were sent (seconds): during their prefill (a chunked one
of several steps here), while the stream writes its first layers."""


@dataclasses.dataclass
class Rig:
    """The module's own prefill engine (restartable), and one proxy per way in front of it and the session's decode
    engine."""

    pair: Any
    spec: EngineSpec
    logs: Path
    prefill: Child
    proxies: dict[str, tuple[str, Child]]
    router: tuple[str, Child] | None = None
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def prefill_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def start_prefill(self) -> float:
        """Start the prefill engine on its ports; seconds until it answered its health check."""
        started = time.monotonic()
        self.prefill = start_engine(self.spec, self.logs)
        wait_healthy([self.prefill], 900)
        return time.monotonic() - started

    def kill_prefill(self) -> None:
        os.killpg(self.prefill.proc.pid, signal.SIGKILL)  # the engine core and its workers too
        self.prefill.proc.wait()

    def start_router(self) -> None:
        """vLLM's router in PD mode (``vllm-router``, Rust) in front of this module's prefill engine and the
        session's, and the session's decode engine: it sends each prefill leg with ``max_tokens`` 1 and copies the
        prefill engine's ``kv_transfer_params`` into the decode leg, as it does for NixlConnector."""
        (port,) = free_ports(1)
        argv = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--vllm-pd-disaggregation", "--prefill", self.prefill_url, "--prefill", self.pair.url("prefill"),
                "--decode", self.pair.url("decode"), "--policy", "round_robin", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1", "--cb-failure-threshold", "1"]
        child = start_child("vllm-router", argv, dict(os.environ), self.logs, f"http://127.0.0.1:{port}/health")
        wait_healthy([child], 120.0)
        self.router = (f"http://127.0.0.1:{port}", child)

    def start_proxy(self, way: str) -> None:
        (port,) = free_ports(1)
        routed = dataclasses.replace(self.pair, proxy_port=port, prefill_port=self.spec.port,
                                     proxy_args=("--transfer-mode", way))
        child = start_child(f"proxy-faults-{way}", routed.proxy_command(),
                            {**os.environ, "P2PKV_SECRET": self.pair.secret}, self.logs,
                            f"http://127.0.0.1:{port}/health")
        wait_healthy([child], 60.0)
        self.proxies[way] = (f"http://127.0.0.1:{port}", child)


@pytest.fixture(scope="module")
def rig(pair, tmp_path_factory) -> Iterator[Rig]:
    p, _ = pair
    logs = tmp_path_factory.mktemp("logs-faults")
    port, side = free_ports(2)
    spec = EngineSpec(name="prefill-faults", model=p.model, port=port, role="prefill", side_channel_port=side,
                      side_channel_host="127.0.0.1", block_size=BLOCK, max_model_len=1024,
                      extra_config={"lease_s": LEASE_S, "stream_min_tokens": 0},
                      env={"UCX_NET_DEVICES": "lo", "P2PKV_SECRET": p.secret},
                      extra_args=("--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)))
    made = Rig(p, spec, logs, start_engine(spec, logs), {})
    try:
        wait_healthy([made.prefill], 900)
        for way in WAYS:
            made.start_proxy(way)
        made.start_router()
        with httpx.Client(timeout=120) as client:  # the stream proxy learns the prefill engine's address
            complete(client, made.proxies["stream"][0], "where is the faults prefill engine", max_tokens=2)
        yield made
    finally:
        stop_children([made.prefill, *(child for _, child in made.proxies.values()),
                       *([made.router[1]] if made.router is not None else [])])
        (logs / "faults.json").write_text(json.dumps(made.figures, indent=2) + "\n")
        print("faults figures:", json.dumps(made.figures))


def _ask(url: str, prompt: str, max_tokens: int = 6) -> tuple[int, list[str] | str, float]:
    """A completions request (its own connection): ``(status, texts or the error, seconds)``."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.monotonic()
    try:
        with httpx.Client(timeout=120.0) as client:
            resp = client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return 0, repr(exc), time.monotonic() - start
    seconds = time.monotonic() - start
    if resp.status_code != 200:
        return resp.status_code, resp.text[:300], seconds
    return 200, [c["text"] for c in resp.json()["choices"]], seconds


def _ask_sse_list(url: str, prompts: list[str], max_tokens: int = 6) -> tuple[int, list[str] | str]:
    """A completions request for a list of prompts answered as one SSE stream: ``(status, each prompt's text, in
    order, or the error)``; an error event in the stream is an error."""
    body = {"model": "model", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    texts = [""] * len(prompts)
    try:
        with httpx.Client(timeout=120.0) as client, client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return resp.status_code, resp.read().decode()[:300]
            for line in resp.iter_lines():
                event = json.loads(line[6:]) if line.startswith("data: {") else {}
                if "error" in event:
                    return 500, str(event)[:300]
                for choice in event.get("choices", []):
                    texts[choice["index"]] += choice["text"]
    except httpx.HTTPError as exc:
        return 0, repr(exc)
    return 200, texts


def _reference(rig: Rig, prompt: str, max_tokens: int = 6) -> list[str]:
    status, texts, _ = _ask(rig.pair.url("aggregated"), prompt, max_tokens)
    assert status == 200
    return texts  # type: ignore[return-value]


ROUTER_PROMPTS = [f"through vLLM's router {i} " + "r" * (i * BLOCK) for i in range(1, 5)]


class RouterLoad:
    """Eight clients sending ``ROUTER_PROMPTS`` through vLLM's router in turn until stopped; each answer compared
    with the aggregated engine's."""

    CLIENTS = 8

    def __init__(self, rig: Rig) -> None:
        assert rig.router is not None
        self.url = rig.router[0]
        self.refs = {prompt: _reference(rig, prompt) for prompt in ROUTER_PROMPTS}
        self.ok = 0
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.CLIENTS)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def summary(self) -> dict[str, Any]:
        return {"ok": self.ok, "errors": len(self.errors), "wrong": len(self.wrong), "first_errors": self.errors[:2]}

    def _client(self, index: int) -> None:
        n = index
        while not self._stop.is_set():
            prompt = ROUTER_PROMPTS[n % len(ROUTER_PROMPTS)]
            n += 1
            status, texts, _ = _ask(self.url, prompt)
            with self._lock:
                if status != 200:
                    self.errors.append(f"{status} {str(texts)[:120]}")
                elif texts != self.refs[prompt]:
                    self.wrong.append(prompt)
                else:
                    self.ok += 1


def _back_to_zero(url: str, timeout_s: float) -> float | None:
    """Seconds until the engine at ``url`` holds no KV blocks (None: not within ``timeout_s``)."""
    start = time.monotonic()
    with httpx.Client(timeout=10.0) as client:
        while kv_cache_usage(client, url) > 0:
            if time.monotonic() - start > timeout_s:
                return None
            time.sleep(0.2)
    return time.monotonic() - start


def test_a_prefill_killed_mid_transfer_ends_every_way_in_seconds_and_its_restart_serves_at_once(rig: Rig) -> None:
    """One prompt of every way in flight when the prefill engine is SIGKILLed: each client gets an error (the
    prefill leg's, at once: the stream's decode leg is cancelled, not left to its window) or the right answer,
    and the decode engine frees what it allocated. Started again on the same ports, the engine serves the very
    next request of every way right (the stream proxy's address is stale: the new process answers for another
    engine id, and the decode leg goes again with its params)."""
    prompts = {way: f"{way} {LONG}" for way in WAYS}
    refs = {way: _reference(rig, prompt) for way, prompt in prompts.items()}
    outcomes: dict[str, tuple[int, Any, float]] = {}
    threads = [threading.Thread(target=lambda w=way: outcomes.__setitem__(w, _ask(rig.proxies[w][0], prompts[w])))
               for way in WAYS]
    load = RouterLoad(rig)
    load.start()
    time.sleep(2.0)  # the router's clients in full swing over both prefill engines
    for thread in threads:
        thread.start()
    time.sleep(KILL_AFTER_S)
    rig.kill_prefill()
    killed = time.monotonic()
    for thread in threads:
        thread.join(timeout=120)
    time.sleep(3.0)
    load.stop()
    rig.figures["router_during_kill"] = load.summary()
    assert not load.wrong, f"the router's clients got wrong tokens: {load.wrong[:3]}"
    assert load.ok > 0, "the router served nothing while one prefill engine lived"
    rig.figures["prefill_killed"] = {way: {"status": s, "seconds": round(t, 2)} for way, (s, _, t) in
                                     outcomes.items()}
    for way, (status, texts, _) in outcomes.items():
        assert status != 200 or texts == refs[way], f"{way}: wrong tokens served after the prefill died"
        assert status in (200, 502, 504), f"{way}: {status} {texts}"
    freed = _back_to_zero(rig.pair.url("decode"), 60.0)
    assert freed is not None, "the decode engine still holds blocks of requests whose prefill died"
    rig.figures["decode_freed_after_kill_s"] = round(time.monotonic() - killed, 2)

    rig.figures["prefill_restart_s"] = round(rig.start_prefill(), 1)
    listed = [f"a list after the restart {i} {LONG}" for i in range(2)]
    got_list: list[Any] = []
    as_list = threading.Thread(target=lambda: got_list.append(_ask_sse_list(rig.proxies["stream"][0], listed)))
    as_list.start()  # with the stream proxy's first single prompt: both find its address stale
    after = {way: _ask(rig.proxies[way][0], f"after the restart {way} {LONG}") for way in WAYS}
    as_list.join(timeout=120)
    assert got_list == [(200, [_reference(rig, prompt)[0] for prompt in listed])], \
        f"a streamed list of streamed prompts after the restart: {got_list}"
    rig.figures["first_after_restart"] = {way: {"status": s, "seconds": round(t, 2)} for way, (s, _, t) in
                                          after.items()}
    for way, (status, texts, _) in after.items():
        assert (status, texts) == (200, _reference(rig, f"after the restart {way} {LONG}")), f"{way}: {texts}"
    load = RouterLoad(rig)
    load.start()
    time.sleep(4.0)
    load.stop()
    rig.figures["router_after_restart"] = load.summary()
    assert not load.wrong and not load.errors, f"the router after the restart: {load.summary()}"
    assert _back_to_zero(rig.prefill_url, LEASE_S + 10) is not None, "the restarted prefill engine holds blocks"
    assert _back_to_zero(rig.pair.url("prefill"), 30) is not None, "the session's prefill engine holds blocks"


@pytest.mark.parametrize("way", WAYS)
def test_a_proxy_killed_mid_answer_leaves_nothing_held_and_another_serves(rig: Rig, way: str) -> None:
    """The proxy SIGKILLed while its client reads the answer: the decode engine aborts the request when its
    connection closes, and the prefill engine's hold is freed (by the decode engine's word, at the latest by
    its lease); a proxy started again serves right."""
    url, child = rig.proxies[way]
    body = {"model": "model", "prompt": f"the proxy dies {way} " + "p" * (4 * BLOCK), "max_tokens": 400,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    with httpx.Client(timeout=60.0) as client, client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            event = json.loads(line[6:]) if line.startswith("data: {") else {}
            assert "error" not in event, event
            if event and event["choices"][0]["text"]:
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
                break
    killed = time.monotonic()
    freed = _back_to_zero(rig.prefill_url, LEASE_S + 10)
    assert freed is not None, "the prefill engine held blocks past its lease after the proxy died"
    decode_freed = _back_to_zero(rig.pair.url("decode"), 30)
    assert decode_freed is not None, "the decode engine kept the dead proxy's request"
    rig.figures[f"proxy_killed_{way}"] = {"prefill_freed_s": round(time.monotonic() - killed, 2)}
    rig.start_proxy(way)
    prompt = f"a new proxy {way}"
    assert _ask(rig.proxies[way][0], prompt)[:2] == (200, _reference(rig, prompt))


@pytest.fixture(scope="module")
def own_decode(rig: Rig) -> Iterator[tuple[EngineSpec, list[Child], dict[str, str]]]:
    """A decode engine of this module's own (it is killed) behind one proxy per way with the module's prefill
    engine: ``(its spec, [its child, the proxies], way → proxy URL)``."""
    p = rig.pair
    port, side = free_ports(2)
    spec = EngineSpec(name="decode-faults", model=p.model, port=port, role="decode", side_channel_port=side,
                      side_channel_host="127.0.0.1", block_size=BLOCK, max_model_len=1024,
                      extra_config={"handshake_timeout_s": 1.5,
                                    "transfer_timeout_s": LEASE_S},  # its pushes' and streams' window
                      env={"UCX_NET_DEVICES": "lo", "P2PKV_SECRET": p.secret})
    children = [start_engine(spec, rig.logs)]
    urls: dict[str, str] = {}
    try:
        wait_healthy(children, 900)
        for way in WAYS:
            (proxy_port,) = free_ports(1)
            routed = dataclasses.replace(p, proxy_port=proxy_port, prefill_port=rig.spec.port, decode_port=port,
                                         proxy_args=("--transfer-mode", way))
            children.append(start_child(f"proxy-decode-faults-{way}", routed.proxy_command(),
                                        {**os.environ, "P2PKV_SECRET": p.secret}, rig.logs,
                                        f"http://127.0.0.1:{proxy_port}/health"))
            urls[way] = f"http://127.0.0.1:{proxy_port}"
        wait_healthy(children[1:], 60.0)
        with httpx.Client(timeout=120) as client:  # its stream proxy learns the prefill engine's address
            complete(client, urls["stream"], "where is the prefill engine for the decode faults", max_tokens=2)
        yield spec, children, urls
    finally:
        stop_children(children)


STOPPED_S = LEASE_S + 6.0
"""How long the decode engine stays stopped (seconds): past the prefill engine's lease and the module decode
engine's window (``transfer_timeout_s``: a push's or stream's WRITE into a stopped process does not complete, and
its blocks stay pinned until the window cuts it), so every hold it never ended must end there on its own."""


STOP_TRIES = 3
"""How many times the decode engine is stopped while the prefill engine holds: a stop that lands after every way's
load finished (its loads are fast and the trigger is a poll of the prefill engine's metrics) holds nothing; it is
let go, its answers checked, and tried again with new prompts."""


def _stop_while_held(rig: Rig, children: list[Child], urls: dict[str, str], attempt: int
                     ) -> tuple[dict[str, str], list[threading.Thread], dict[str, tuple[int, Any, float]], float]:
    """Sends a prompt of every way through ``urls`` and SIGSTOPs the decode engine's process group as soon as the
    prefill engine holds KV blocks: ``(way → prompt, the clients' threads, way → (status, texts, seconds), when it
    was stopped)``. The engine is left stopped."""
    prompts = {way: f"the decode stops {way} {attempt} {LONG}" for way in WAYS}
    outcomes: dict[str, tuple[int, Any, float]] = {}
    threads = [threading.Thread(target=lambda w=way: outcomes.__setitem__(w, _ask(urls[w], prompts[w])))
               for way in WAYS]
    for thread in threads:
        thread.start()
    with httpx.Client(timeout=10.0) as client:  # the prefill legs under way: the decode legs' loads not done
        deadline = time.monotonic() + 30.0
        while kv_cache_usage(client, rig.prefill_url) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    os.killpg(children[0].proc.pid, signal.SIGSTOP)
    return prompts, threads, outcomes, time.monotonic()


def _check_answers(rig: Rig, prompts: dict[str, str], threads: list[threading.Thread],
                   outcomes: dict[str, tuple[int, Any, float]]) -> None:
    """Waits for the clients; an answer is the aggregated engine's tokens or an error, never other tokens."""
    for thread in threads:
        thread.join(timeout=120)
    assert set(outcomes) == set(WAYS), f"a client never got an answer: {sorted(outcomes)}"
    for way, (status, texts, _) in outcomes.items():
        assert status != 200 or texts == _reference(rig, prompts[way]), \
            f"{way}: wrong tokens served by a decode engine that stopped"
        assert status in (200, 500, 502, 504), f"{way}: {status} {texts}"


def test_a_decode_that_stops_answering_leaves_nothing_held_past_the_lease_and_never_serves_wrong_tokens(
        rig: Rig, own_decode: tuple[EngineSpec, list[Child], dict[str, str]]) -> None:
    """The decode engine SIGSTOPped (its side channel, its HTTP server and its NIXL progress stop at once) just
    after a prompt of every way was sent, so its loads are in flight: the prefill engine frees every hold at its
    lease, or a WRITE's window, without a word from it; started again (SIGCONT) after that, it answers each
    client with the right tokens or an error (a pull's blocks may be gone and reused by then: its fence must not
    let them be served), frees what it allocated, and serves every way right next."""
    spec, children, urls = own_decode
    for attempt in range(STOP_TRIES):
        assert _back_to_zero(rig.prefill_url, LEASE_S + 10) is not None, "the prefill engine held blocks before"
        prompts, threads, outcomes, stopped = _stop_while_held(rig, children, urls, attempt)
        time.sleep(1.0)
        with httpx.Client(timeout=10.0) as client:
            held = kv_cache_usage(client, rig.prefill_url)
        if held > 0:
            break
        os.killpg(children[0].proc.pid, signal.SIGCONT)  # stopped after the loads: their answers must be right
        _check_answers(rig, prompts, threads, outcomes)
    else:
        pytest.fail(f"the prefill engine held nothing while the decode engine was stopped, {STOP_TRIES} times")
    try:
        freed = _back_to_zero(rig.prefill_url, STOPPED_S)
        assert freed is not None, "the prefill engine held blocks past its lease for a decode engine that stopped"
        rig.figures["decode_stopped"] = {"prefill_freed_s": round(time.monotonic() - stopped, 2),
                                         "tries": attempt + 1}
        time.sleep(max(0.0, STOPPED_S - (time.monotonic() - stopped)))
    finally:
        os.killpg(children[0].proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    _check_answers(rig, prompts, threads, outcomes)
    rig.figures["decode_stopped"]["stopped_s"] = round(resumed - stopped, 2)
    rig.figures["decode_stopped"]["answers"] = {way: {"status": s, "seconds": round(t, 2)}  # the whole request
                                                for way, (s, _, t) in outcomes.items()}
    assert _back_to_zero(f"http://127.0.0.1:{spec.port}", 30) is not None, \
        "the decode engine kept blocks of the stopped requests"
    for way in WAYS:
        prompt = f"after the decode resumed {way}"
        assert _ask(urls[way], prompt)[:2] == (200, _reference(rig, prompt)), way


def test_a_decode_killed_mid_transfer_fails_its_clients_frees_the_prefill_and_its_restart_serves(
        rig: Rig, own_decode: tuple[EngineSpec, list[Child], dict[str, str]]) -> None:
    """The decode engine SIGKILLed while a prompt of every way is being moved to it (as soon as the prefill engine
    holds its blocks: a stream's layers are being WRITten, a pull or push waits for the prefill's answer): each
    client's stream ends (an error, or a closed connection), the prefill engine frees every hold (NIXL's
    disconnect fails a WRITE into the dead process at once; the lease ends the rest), and the decode engine
    started again on the same ports serves every way right."""
    spec, children, urls = own_decode
    ended: dict[str, float] = {}
    texts = dict.fromkeys(WAYS, "")

    def read(way: str) -> None:
        body = {"model": "model", "prompt": f"the decode dies {way} {LONG}", "max_tokens": 200,
                "ignore_eos": True, "temperature": 0.0, "stream": True}
        with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=60.0) as client, client.stream(
                "POST", f"{urls[way]}/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                event = json.loads(line[6:]) if line.startswith("data: {") else {}
                texts[way] += "".join(c.get("text", "") for c in event.get("choices", []))
        ended[way] = time.monotonic()

    threads = [threading.Thread(target=read, args=(way,)) for way in WAYS]
    for thread in threads:
        thread.start()
    with httpx.Client(timeout=10.0) as client:  # the prefill legs under way: the loads not done
        deadline = time.monotonic() + 30.0
        while kv_cache_usage(client, rig.prefill_url) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert not ended, f"answers ended before the decode engine was killed: {sorted(ended)}"
    os.killpg(children[0].proc.pid, signal.SIGKILL)
    children[0].proc.wait()
    killed = time.monotonic()
    for thread in threads:
        thread.join(timeout=60)
    assert set(ended) == set(WAYS), "a client's stream from a dead decode engine never ended"
    for way in WAYS:  # what a client got before the engine died is the start of the right answer
        ref = _reference(rig, f"the decode dies {way} {LONG}", max_tokens=200)[0]
        assert ref.startswith(texts[way]), f"{way}: wrong tokens before the decode engine died: {texts[way]!r}"
    rig.figures["decode_killed"] = {way: {"client_ended_s": round(t - killed, 2)} for way, t in ended.items()}
    freed = _back_to_zero(rig.prefill_url, LEASE_S + 10)
    assert freed is not None, "the prefill engine held blocks past its lease after the decode engine died"
    rig.figures["decode_killed"]["prefill_freed_s"] = round(time.monotonic() - killed, 2)
    started = time.monotonic()
    children[0] = start_engine(spec, rig.logs)
    wait_healthy([children[0]], 900)
    rig.figures["decode_restart_s"] = round(time.monotonic() - started, 1)
    for way in WAYS:
        prompt = f"after the decode restart {way}"
        assert _ask(urls[way], prompt)[:2] == (200, _reference(rig, prompt)), way
