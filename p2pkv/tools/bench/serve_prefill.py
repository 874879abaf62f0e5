"""Is the prefill engine slowed? Its own latency over a ``p2pkv bench serve`` point.

In push mode the prefill engine's worker WRITEs held blocks into the decode
engine from a thread of its own process, while the same engine keeps
prefilling the next requests. Two measurements say whether that costs the
prefill engine time, per point and system (compared in the same run with
the same engines pulling, :data:`~p2pkv.tools.bench.serve_systems.PUSH_BASELINE`):

- always, from ``/metrics`` deltas (:func:`prefill_latency`): the prefill
  legs' round trip as the proxy sees it (``p2pkv_proxy_prefill_seconds``) and
  the prefill engine's own TTFT, queue and prefill time (vLLM's histograms);
- with ``--prefill-probe`` (:class:`PrefillProbe`): requests of the prefill
  engine's own, sent straight to it one at a time while the point runs; their
  TTFT and TPOT (exact, per request) show what an ordinary request on that
  engine goes through while it serves, and pushes, the point's KV.

Units: ms (Prometheus' seconds are converted).
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

from p2pkv.tools.bench.serve_metrics import PROXY_PREFILL, Snapshot, latency, mean_ms
from p2pkv.tools.bench.serve_results import Latency, Percentiles, PrefillLatency, ProbeResult

ENGINE_TTFT = "vllm:time_to_first_token_seconds"
"""vLLM's TTFT histogram (a request's arrival at the engine → its first token), seconds."""
ENGINE_QUEUE = "vllm:request_queue_time_seconds"
"""vLLM's histogram of a request's time waiting to be scheduled, seconds."""
ENGINE_PREFILL = "vllm:request_prefill_time_seconds"
"""vLLM's histogram of a request's prefill phase (scheduled → first token), seconds."""

PROBE_TIMEOUT_S = 120.0
"""Most seconds one probe request may take."""
PROBE_START_S = 10.0
"""Most seconds :meth:`PrefillProbe.start` waits for the probe's thread to be ready to send."""


def prefill_latency(prefill: Snapshot | None, proxy: Snapshot | None,
                    probe: ProbeResult | None = None) -> PrefillLatency | None:
    """The prefill engine's own latency over one point.

    Args:
        prefill: ``after - before`` of the prefill engine's scrapes (None: not scraped).
        proxy: ``after - before`` of the proxy's scrapes (None: no proxy).
        probe: what the probe measured in the point, if it ran.

    Returns:
        The latency, or None when neither the prefill engine nor the proxy was scraped.
    """
    if prefill is None and proxy is None:
        return None
    legs: Latency | None = latency(proxy, PROXY_PREFILL) if proxy is not None else None
    return PrefillLatency(legs=legs, engine_ttft=latency(prefill, ENGINE_TTFT) if prefill is not None else None,
                          engine_queue_mean_ms=mean_ms(prefill, ENGINE_QUEUE),
                          engine_prefill_mean_ms=mean_ms(prefill, ENGINE_PREFILL), probe=probe)


def probe_prompt(index: int, chars: int, seed: int) -> str:
    """The ``index``-th probe prompt: ``chars`` readable random characters (one token each with the tiny
    model's byte-level tokenizer), different from every benchmark prompt and from each other."""
    from p2pkv.tools.bench.serve_client import TEXT_ALPHABET

    rng = random.Random(f"probe-{seed}-{index}")
    return "".join(rng.choice(TEXT_ALPHABET) for _ in range(chars))


def stream_timing(lines: Any, sent: float, clock: Any = time.perf_counter) -> tuple[float, float, int]:
    """Read one streamed completion (server-sent ``data:`` lines) and time it.

    Args:
        lines: its lines, as they arrive.
        sent: ``clock()`` when the request was sent.
        clock: the clock (seconds).

    Returns:
        ``(seconds to the first token, seconds from the first to the last
        token, output tokens)``; tokens from the ``usage`` chunk when sent,
        else the chunks that carried text.

    Raises:
        ValueError: the stream carried no token.
    """
    first = last = None
    chunks, usage_tokens = 0, None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        msg = json.loads(data)
        if msg.get("usage"):
            usage_tokens = int(msg["usage"].get("completion_tokens") or 0)
        if any(c.get("text") for c in msg.get("choices") or []):
            now = clock()
            first = now if first is None else first
            last = now
            chunks += 1
    if first is None or last is None:
        raise ValueError("the stream carried no token")
    return first - sent, last - first, usage_tokens or chunks


class PrefillProbe:
    """Requests of the prefill engine's own, one at a time from a thread, while a point runs.

    Every point gets at least one probe request: :meth:`start` returns once
    the thread is about to send its first, and the thread checks for
    :meth:`stop` only after a request has ended (a point shorter than one
    probe request still measures that request, the one it overlapped).

    Args:
        url: the prefill engine (``http://host:port``).
        prompt_chars: characters per probe prompt.
        max_tokens: tokens each probe request generates (greedy, EOS ignored).
        seed: picks the prompts.
    """

    def __init__(self, url: str, prompt_chars: int, max_tokens: int, seed: int) -> None:
        self.url, self.prompt_chars, self.max_tokens, self.seed = url, prompt_chars, max_tokens, seed
        self._stop = threading.Event()
        self._sending = threading.Event()
        self._thread: threading.Thread | None = None
        self._ttfts: list[float] = []
        self._tpots: list[float] = []
        self._failed = 0
        self._first_error = ""

    def start(self) -> PrefillProbe:
        """Start sending; returns (self) once the first request is about to be sent."""
        self._thread = threading.Thread(target=self._run, name="prefill-probe", daemon=True)
        self._thread.start()
        self._sending.wait(PROBE_START_S)
        return self

    def stop(self) -> ProbeResult:
        """Stop after the request in flight ends; what the probe measured."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(PROBE_TIMEOUT_S + 5.0)
            if self._thread.is_alive():
                self._fail(f"a probe request still ran {PROBE_TIMEOUT_S + 5.0:.0f} s after the point ended")
        return ProbeResult(requests=len(self._ttfts), failed=self._failed, ttft_ms=Percentiles.of(self._ttfts),
                           tpot_ms=Percentiles.of(self._tpots), first_error=self._first_error)

    def _fail(self, message: str) -> None:
        self._failed += 1
        self._first_error = self._first_error or message

    def _run(self) -> None:
        import httpx

        try:
            client = httpx.Client(timeout=httpx.Timeout(PROBE_TIMEOUT_S))
        except Exception as exc:  # reported as the probe's failure, never a dead thread
            self._fail(f"{type(exc).__name__}: {exc}")
            self._sending.set()
            return
        with client:
            index = 0
            while True:
                self._sending.set()
                self._one(client, index)
                index += 1
                if self._stop.is_set():
                    return

    def _one(self, client: Any, index: int) -> None:
        """Send probe request ``index`` and record its timing or its failure."""
        body = {"model": "model", "prompt": probe_prompt(index, self.prompt_chars, self.seed),
                "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                ttft, span, tokens = stream_timing(resp.iter_lines(), sent)
        except Exception as exc:  # any failure is counted and named, the probe goes on
            self._fail(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.1)
            return
        self._ttfts.append(1e3 * ttft)
        if tokens > 1:
            self._tpots.append(1e3 * span / (tokens - 1))
