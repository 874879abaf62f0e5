"""``--prefill-probe``: is the prefill engine slowed while it serves, and pushes, a point's KV?

In push mode the prefill engine's worker WRITEs held blocks into the decode
engine from a thread of its own process, while the same engine keeps
prefilling the next requests. Besides the ``/metrics`` deltas
(:func:`p2pkv.tools.bench.serve_metrics.prefill_latency`), :class:`PrefillProbe`
sends the prefill engine requests of its own, one at a time, while the point
runs; their TTFT and TPOT (exact, per request) show what an ordinary request
on that engine goes through meanwhile. Units: ms.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

PROBE_TIMEOUT_S = 120.0
"""Most seconds one probe request may take."""
PROBE_START_S = 10.0
"""Most seconds :meth:`PrefillProbe.start` waits for the probe's thread to be ready to send."""


def p50_p99(values_ms: Sequence[float]) -> tuple[float | None, float | None]:
    """Median and 99th percentile (linear interpolation, as vLLM's client) of values in ms; Nones for none."""
    import numpy as np

    return (float(np.percentile(values_ms, 50)), float(np.percentile(values_ms, 99))) if values_ms else (None, None)


def probe_prompt(index: int, chars: int, seed: int) -> str:
    """The ``index``-th probe prompt: ``chars`` readable random characters (one token each with the tiny
    model's byte-level tokenizer), different from every benchmark prompt and from each other."""
    from p2pkv.tools.bench.serve_client import TEXT_ALPHABET

    rng = random.Random(f"probe-{seed}-{index}")
    return "".join(rng.choice(TEXT_ALPHABET) for _ in range(chars))


def stream_timing(lines: Any, sent: float, clock: Any = time.perf_counter) -> tuple[float, float, int]:
    """``(seconds to the first token, seconds from the first to the last token, output tokens)`` of one
    streamed completion (its server-sent ``data:`` lines, as they arrive) sent at ``clock()`` = ``sent``;
    tokens from the ``usage`` chunk when sent, else the chunks that carried text. Raises ValueError when the
    stream carried no token."""
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
    """Requests of the prefill engine's own, one at a time from a thread, while a point runs: ``prompt_chars``
    characters each (``seed`` picks them), ``max_tokens`` generated (greedy, EOS ignored), sent to ``url``.

    Every point gets at least one: :meth:`start` returns once the thread is about to send its first, and
    the thread checks for :meth:`stop` only after a request has ended.
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

    def stop(self) -> dict[str, Any]:
        """Stop after the request in flight ends; what the probe measured: ``requests``, ``failed``,
        ``ttft_p50_ms``, ``ttft_p99_ms``, ``tpot_p50_ms``, ``tpot_p99_ms`` (TPOT: (last - first token) /
        (tokens - 1), vLLM's definition), ``first_error`` ("" when none failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(PROBE_TIMEOUT_S + 5.0)
            if self._thread.is_alive():
                self._fail(f"a probe request still ran {PROBE_TIMEOUT_S + 5.0:.0f} s after the point ended")
        (t50, t99), (p50, p99) = p50_p99(self._ttfts), p50_p99(self._tpots)
        return {"requests": len(self._ttfts), "failed": self._failed, "ttft_p50_ms": t50, "ttft_p99_ms": t99,
                "tpot_p50_ms": p50, "tpot_p99_ms": p99, "first_error": self._first_error}

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
