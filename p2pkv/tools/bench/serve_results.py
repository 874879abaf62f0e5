"""The results of ``p2pkv bench serve`` as typed structs, and their JSON form.

One run is a :class:`ServeResult`: per system a :class:`SystemResult` with a
:class:`PointResult` per concurrency point (vLLM's client numbers, the decode
engine's :class:`PullStats`, the proxy's :class:`ProxyOverhead`, the
:class:`Handover` breakdown and the prefill engine's own
:class:`PrefillLatency`), the answer :class:`Check` s, :class:`Ratio` s
against baselines of the same run and the :class:`Target` s.
:meth:`ServeResult.to_json` gives the document ``--json`` writes (plain
dicts and lists; the keys are the fields' names). Units: ms unless a name
says otherwise (``_s`` seconds, ``bytes``), throughput in requests/s and
output tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pkv.tools.bench.serve_options import ServeBenchOptions


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of sorted values, linearly interpolated (numpy's default, as vLLM's
    client computes its percentiles).

    Raises:
        ValueError: no values.
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class Percentiles:
    """Mean, median and 99th percentile of a latency (ms; None where not measured)."""

    mean: float | None = None
    p50: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Percentiles:
        """Exact statistics of per-request values (ms); all None for no values."""
        if not values_ms:
            return cls()
        s = sorted(values_ms)
        return cls(sum(s) / len(s), percentile(s, 50), percentile(s, 99))


@dataclass(frozen=True)
class PullStats:
    """The decode engine's transfers over one point (its ``/metrics`` delta).

    Attributes:
        pulls: completed transfers (pulls, whichever way the bytes moved).
        bytes: bytes moved.
        seconds_total: their summed duration (seconds).
        mean_ms: mean duration per transfer (ms).
        descriptors_mean: NIXL descriptors per transfer (None when not exported).
        directions: completed transfers by direction (``pull``: the decode
            engine READ; ``push``: the prefill engine WROTE), from
            ``p2pkv:pulls_by_direction_total``; empty where not exported (NixlConnector).
    """

    pulls: int
    bytes: int
    seconds_total: float
    mean_ms: float | None
    descriptors_mean: float | None
    directions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ProxyOverhead:
    """The proxy's own latency over one point (its histograms' delta).

    Attributes:
        requests: requests the proxy handled.
        p50_bound_ms: upper bound of the median of the time it adds per request
            (a histogram bucket bound; None when empty or past the last finite bucket).
        mean_ms: mean time it adds per request.
        prefill_mean_ms: the prefill request's mean round trip.
    """

    requests: int
    p50_bound_ms: float | None
    mean_ms: float | None
    prefill_mean_ms: float | None


@dataclass(frozen=True)
class Latency:
    """A latency from a Prometheus histogram's delta over one point.

    Attributes:
        count: observations.
        mean_ms: their exact mean (sum / count).
        p50_ms / p99_ms: estimated by linear interpolation inside the histogram
            bucket that holds them (as Prometheus' ``histogram_quantile``), so
            only as fine as the buckets; None without observations.
    """

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True)
class ProbeResult:
    """The prefill engine's own requests sent by ``--prefill-probe`` during one point.

    One probe request at a time goes straight to the prefill engine (no
    ``kv_transfer_params``: an ordinary request, streamed), the next as soon
    as the last ends, for as long as the point's client runs, and at least
    one per point.

    Attributes:
        requests: probe requests that completed.
        failed: probe requests that failed.
        ttft_ms: time to the first streamed token, per request.
        tpot_ms: (last token - first token) / (output tokens - 1), per request
            (vLLM's definition of TPOT): the prefill engine's step time while it served the point.
        first_error: the first failure's message ("" when none failed).
    """

    requests: int
    failed: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    first_error: str = ""


@dataclass(frozen=True)
class PrefillLatency:
    """The prefill engine's own latency over one point: how long its requests took while the point ran.

    Attributes:
        legs: the proxy's prefill request round trip (``p2pkv_proxy_prefill_seconds``,
            each P/D request's prefill leg: one generated token), as the proxy saw it.
        engine_ttft: the prefill engine's ``vllm:time_to_first_token_seconds``
            (a request's arrival at that engine to its first token).
        engine_queue_mean_ms: the prefill engine's ``vllm:request_queue_time_seconds``, mean.
        engine_prefill_mean_ms: the prefill engine's ``vllm:request_prefill_time_seconds``
            (scheduled to first token), mean.
        probe: the probe's requests (``--prefill-probe``), or None when off.

    With the probe on, the ``engine_*`` figures count the probe's requests too
    (``engine_ttft.count`` = legs + probe requests); ``legs`` never does.
    """

    legs: Latency | None
    engine_ttft: Latency | None
    engine_queue_mean_ms: float | None
    engine_prefill_mean_ms: float | None
    probe: ProbeResult | None = None


@dataclass(frozen=True)
class Handover:
    """Where a P/D request's first token waited over one point: the mean of each phase (ms; None where the
    system does not export it). See :mod:`p2pkv.tools.bench.handover` for the metric of each.

    Attributes:
        prefill: the proxy's prefill request round trip.
        decode_first_byte: decode request sent → first streamed bytes relayed.
        queue / dispatch / post / read / confirm: the decode engine's pull phases
            (:data:`p2pkv.telemetry.stats.PULL_PHASES`; NixlConnector exports only ``read``).
        decode_ttft: the decode engine's own TTFT.
        proxy: the proxy's own time per request.
        read_p50_bound_ms: the ``read`` phase's median bucket bound (p2pkv only).
        first_token_from_prefill / first_token_from_decode: streaming requests
            whose first token the proxy sent from the prefill answer, or took
            from the decode engine (None without the proxy's counter).
    """

    prefill: float | None = None
    decode_first_byte: float | None = None
    queue: float | None = None
    dispatch: float | None = None
    post: float | None = None
    read: float | None = None
    confirm: float | None = None
    decode_ttft: float | None = None
    proxy: float | None = None
    read_p50_bound_ms: float | None = None
    first_token_from_prefill: int | None = None
    first_token_from_decode: int | None = None

    def phase(self, name: str) -> float | None:
        """The mean (ms) of the phase called ``name`` (None for an unknown name)."""
        value = getattr(self, name, None)
        return None if value is None else float(value)


@dataclass
class PointResult:
    """One concurrency point of one system.

    Attributes:
        concurrency: ``--max-concurrency`` (requests in flight).
        seed: the dataset seed (the same prompts in every system).
        num_prompts: requests sent.
        completed / failed: requests that succeeded / failed.
        duration_s: the point's wall time (seconds).
        request_throughput / output_throughput: requests/s, output tokens/s.
        total_output_tokens: tokens generated.
        ttft_ms / tpot_ms / itl_ms / e2el_ms: vLLM's client numbers (its p50 and p99).
        second_token_ms: each request's time to its second token (TTFT + first ITL).
        pull: the decode engine's transfers (None: not a P/D pair, or not exported).
        proxy_overhead: the proxy's own latency (None without a proxy).
        handover: the phase breakdown (None without a proxy).
        prefill: the prefill engine's own latency (None without a prefill engine).
        answers_sha256: SHA-256 over the generated texts in request order.
    """

    concurrency: int
    seed: int
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_output_tokens: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2el_ms: Percentiles
    second_token_ms: Percentiles = field(default_factory=Percentiles)
    pull: PullStats | None = None
    proxy_overhead: ProxyOverhead | None = None
    handover: Handover | None = None
    prefill: PrefillLatency | None = None
    answers_sha256: str = ""

    @classmethod
    def from_client(cls, raw: Mapping[str, Any], concurrency: int = 1, seed: int = 0,
                    num_prompts: int = 0) -> PointResult:
        """The client's numbers of one point from vLLM's ``bench serve`` result dict (run with
        ``--metric-percentiles 50,99``); the engine-side parts stay None.

        Raises:
            KeyError: not a ``bench serve`` result (no ``completed``).
        """
        def stats(metric: str) -> Percentiles:
            return Percentiles(*(_float(raw.get(f"{k}_{metric}_ms")) for k in ("mean", "median", "p99")))

        return cls(concurrency=concurrency, seed=seed, num_prompts=num_prompts,
                   completed=int(raw["completed"]), failed=int(raw.get("failed", 0)),
                   duration_s=float(raw.get("duration", 0.0)),
                   request_throughput=float(raw.get("request_throughput", 0.0)),
                   output_throughput=float(raw.get("output_throughput", 0.0)),
                   total_output_tokens=int(raw.get("total_output_tokens", 0)),
                   ttft_ms=stats("ttft"), tpot_ms=stats("tpot"), itl_ms=stats("itl"), e2el_ms=stats("e2el"))


def _float(v: Any) -> float | None:
    """A plain float (vLLM reports numpy scalars, which JSON and ``is False`` checks do not take)."""
    return None if v is None else float(v)


@dataclass
class SystemResult:
    """One system's run.

    Attributes:
        label: what the system is.
        url: where its requests went (its proxy, or the aggregated engine).
        startup_s: seconds until its engines and proxy were healthy (shared
            engines: until its own proxy was; the pair's start counts for the first).
        engines: the systems that ran on the same engines (this one among them).
        points: one per concurrency, in sweep order.
        warmup_errors: failed warm-up requests (not measured).
        error: why the system stopped early (did not start, or a point raised), or None.
    """

    label: str
    url: str = ""
    startup_s: float | None = None
    engines: list[str] = field(default_factory=list)
    points: list[PointResult] = field(default_factory=list)
    warmup_errors: list[str] = field(default_factory=list)
    error: str | None = None

    def point(self, concurrency: int) -> PointResult | None:
        """The point at ``concurrency``, or None."""
        return next((p for p in self.points if p.concurrency == concurrency), None)


@dataclass(frozen=True)
class Check:
    """One check of the run (``requests``, ``answers``, ``tokens``, ``directions``).

    Attributes:
        passed: it passed.
        detail: what was compared, or what failed.
        compared: answers compared (answer checks only).
        systems: systems compared (answer checks only).
    """

    passed: bool
    detail: str
    compared: int | None = None
    systems: list[str] | None = None


@dataclass(frozen=True)
class Ratio:
    """``system / baseline`` at one concurrency, both measured in the same run (None where either lacks
    the number). Latencies: below 1 is better; throughput: above 1 is better.

    Attributes:
        system / baseline: the two systems.
        concurrency: the point.
        ttft_p50 / ttft_p99 / tpot_p50: the client's TTFT and TPOT.
        request_throughput / output_throughput: requests/s, output tokens/s.
        prefill_legs_mean: the prefill legs' mean round trip through the proxy.
        prefill_engine_ttft_mean: the prefill engine's own mean TTFT.
        probe_ttft_p50 / probe_tpot_p50: the probe's requests on the prefill engine.
    """

    system: str
    baseline: str
    concurrency: int
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    request_throughput: float | None
    output_throughput: float | None
    prefill_legs_mean: float | None = None
    prefill_engine_ttft_mean: float | None = None
    probe_ttft_p50: float | None = None
    probe_tpot_p50: float | None = None


def all_met(oks: Sequence[bool | None]) -> bool | None:
    """A :class:`Target`'s ``met`` from its checks': False if any failed, None if none ran or one could not be
    measured, else True."""
    if any(o is False for o in oks):
        return False
    if not oks or any(o is None for o in oks):
        return None
    return True


@dataclass(frozen=True)
class Target:
    """One target checked against the run.

    Attributes:
        name: short name.
        target: what it asks, in words.
        measured: the numbers behind it, per system and concurrency (``"<system> c=<n>"`` or the concurrency).
        met: True, False, or None when a system it needs was not run or a number is missing.
    """

    name: str
    target: str
    measured: dict[Any, Any]
    met: bool | None


@dataclass
class ServeResult:
    """One run of ``p2pkv bench serve``.

    Attributes:
        command: the command line.
        machine: the host (CPU, cores, RAM, versions, load average at start and end).
        config: the options, the model resolved to its path.
        seeds: concurrency → dataset seed of that point.
        systems: name → its result, in run order.
        checks: ``requests``, ``answers``, ``tokens``, ``directions``.
        ratios: against baselines measured in the same run.
        targets: the targets and whether they were met.
    """

    command: str
    machine: dict[str, Any]
    config: ServeBenchOptions
    seeds: dict[int, int]
    systems: dict[str, SystemResult] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)
    ratios: list[Ratio] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    def point(self, system: str, concurrency: int) -> PointResult | None:
        """``system``'s point at ``concurrency``, or None (system not run, or no such point)."""
        sys_result = self.systems.get(system)
        return sys_result.point(concurrency) if sys_result else None

    def to_json(self) -> dict[str, Any]:
        """The JSON document: ``command``, ``machine``, ``config`` (the options plus ``engine_args`` and
        ``seeds``), ``systems``, ``checks``, ``ratios``, ``targets``."""
        cfg = self.config
        return {"command": self.command, "machine": self.machine,
                "config": {**dataclasses.asdict(cfg), "engine_args": list(cfg.engine_args()),
                           "seeds": {str(c): s for c, s in self.seeds.items()}},
                "systems": {n: dataclasses.asdict(s) for n, s in self.systems.items()},
                "checks": {n: {k: v for k, v in dataclasses.asdict(c).items() if v is not None}
                           for n, c in self.checks.items()},
                "ratios": [dataclasses.asdict(r) for r in self.ratios],
                "targets": [dataclasses.asdict(t) for t in self.targets]}
