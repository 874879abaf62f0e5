"""Start the engines and proxies of one group of ``p2pkv bench serve`` systems (see
:func:`p2pkv.tools.bench.serve_options.plan_groups`).

A group is one aggregated engine, or one prefill/decode pair with a proxy
per system: the pair's own proxy (``--base-port``) for the first system,
one more proxy for each further system (``--base-port`` +600, +601), each
with its system's ``--transfer-mode``. A proxy starts in seconds; the
engines, which take minutes on a CPU host, start once.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pkv.tools.bench.serve_metrics import NIXL_PULL, P2PKV_PULL
from p2pkv.tools.bench.serve_options import EXTRA_PROXY_PORT, SYSTEM_SPECS, ServeBenchOptions, SystemSpec

PROXY_START_TIMEOUT_S = 60.0
"""Seconds a proxy may take to answer its health check."""


@dataclass
class Deployment:
    """A started system: ``name``; ``url``, where its client sends requests (its proxy, or the aggregated
    engine); ``startup_s``, seconds until it was healthy (a shared pair's start counts for its first
    system); ``decode_url`` / ``prefill_url`` / ``proxy_url`` to scrape (None for the aggregated engine);
    ``pull_names``, the decode engine's transfer metrics (:data:`~p2pkv.tools.bench.serve_metrics.P2PKV_PULL`
    or ``NIXL_PULL``)."""

    name: str
    url: str
    startup_s: float
    decode_url: str | None = None
    prefill_url: str | None = None
    proxy_url: str | None = None
    pull_names: dict[str, str] | None = None


@dataclass
class StartedGroup:
    """The systems of one group (a :class:`Deployment` each, in the group's order), all started; ``stop``
    stops every process the group started (idempotent)."""

    systems: list[Deployment]
    stop: Callable[[], None] = field(repr=False)


def proxy_args(spec: SystemSpec, opts: ServeBenchOptions) -> tuple[str, ...]:
    """The ``p2pkv proxy`` flags of ``spec``'s proxy."""
    mode = ("--transfer-mode", spec.transfer_mode) if spec.transfer_mode else ()
    return ("--first-token-from", opts.first_token_from, *mode)


def _proxies(specs: Sequence[SystemSpec], opts: ServeBenchOptions, prefill: str, decode: str, ports: Sequence[int],
             env: dict[str, str], log_dir: Path, t0: float) -> tuple[list[Deployment], list[Any]]:
    """A proxy per system in front of the pair at ``prefill`` and ``decode`` (URLs), on ``ports``; the first
    system's start counts from ``t0``. Raises LaunchError (the proxies started are stopped)."""
    from p2pkv.tools.deploy.checks import check_port_free
    from p2pkv.tools.deploy.processes import start_child, stop_children, wait_healthy

    children: list[Any] = []
    started = []
    try:
        for spec, port in zip(specs, ports, strict=True):
            t1, url = time.monotonic(), f"http://{opts.host}:{port}"
            check_port_free(opts.host, port, f"--base-port (the {spec.name} proxy)")
            argv = [sys.executable, "-m", "p2pkv.tools.proxy", "--host", opts.host, "--port", str(port),
                    "--prefill", prefill.split("://", 1)[-1], "--decode", decode.split("://", 1)[-1],
                    *proxy_args(spec, opts)]
            children.append(start_child(f"proxy-{spec.name}", argv, env, log_dir, f"{url}/health"))
            wait_healthy(children[-1:], PROXY_START_TIMEOUT_S)
            pulls = P2PKV_PULL if spec.connector == "p2pkv" else NIXL_PULL
            started.append(Deployment(spec.name, url, time.monotonic() - (t0 if not started else t1), decode_url=decode,
                                      prefill_url=prefill, proxy_url=url, pull_names=pulls))
    except BaseException:
        stop_children(children)
        raise
    return started, children


def start_group(names: Sequence[str], opts: ServeBenchOptions, model: str, log_dir: Path) -> StartedGroup:
    """Start the engines of ``names`` (one group of :func:`~p2pkv.tools.bench.serve_options.plan_groups`)
    and a proxy per system, or only the proxies in front of ``--p2pkv-engines``; wait until all are healthy.

    Raises:
        LaunchError: a process died or never became healthy (everything the group started is stopped).
    """
    from p2pkv.tools.deploy.checks import check_port_free
    from p2pkv.tools.deploy.engines import EngineSpec, start_engine
    from p2pkv.tools.deploy.local import LocalPair
    from p2pkv.tools.deploy.processes import stop_children, wait_healthy

    b, host, t0 = opts.base_port, opts.host, time.monotonic()
    max_len = max(2048, opts.input_len + opts.output_len)
    specs = [SYSTEM_SPECS[n] for n in names]
    extra_ports = [b + EXTRA_PROXY_PORT + i for i in range(len(specs) - 1)]
    if specs[0].connector is None and opts.aggregated_engine:
        return StartedGroup([Deployment(names[0], opts.aggregated_engine, 0.0)], lambda: None)
    if specs[0].connector is None:
        check_port_free(host, b + 300, "--base-port (+300, aggregated)")
        engine = EngineSpec(name="aggregated", model=model, port=b + 300, host=host, block_size=opts.block_size,
                            dtype=opts.dtype, max_model_len=max_len, tensor_parallel_size=opts.tensor_parallel_size,
                            env={"UCX_NET_DEVICES": "lo"}, extra_args=opts.engine_args())
        children = [start_engine(engine, log_dir)]
        try:
            wait_healthy(children, opts.start_timeout_s)
        except BaseException:
            stop_children(children)
            raise
        url = f"http://{host}:{engine.port}"
        return StartedGroup([Deployment(names[0], url, time.monotonic() - t0)], lambda: stop_children(children))
    if any(s.connector != specs[0].connector for s in specs):
        raise ValueError(f"systems {', '.join(names)} do not share one kind of engines")
    if specs[0].connector == "p2pkv" and opts.p2pkv_engines:
        started, proxies = _proxies(specs, opts, *opts.p2pkv_engines, [b, *extra_ports], dict(os.environ), log_dir,
                                    t0)
        return StartedGroup(started, lambda: stop_children(proxies))
    pair = LocalPair(model=model, host=host, proxy_port=b, prefill_port=b + 100, decode_port=b + 200,
                     side_channel_port=b + 400, block_size=opts.block_size, dtype=opts.dtype,
                     max_model_len=max_len, log_dir=log_dir, connector=specs[0].connector,
                     tensor_parallel_size=opts.tensor_parallel_size, engine_args=opts.engine_args(),
                     proxy_args=proxy_args(specs[0], opts))
    pair.start(timeout_s=opts.start_timeout_s)
    first = Deployment(names[0], pair.url("proxy"), time.monotonic() - t0, pair.url("decode"), pair.url("prefill"),
                       pair.url("proxy"), P2PKV_PULL if specs[0].connector == "p2pkv" else NIXL_PULL)
    try:
        started, extra = _proxies(specs[1:], opts, pair.url("prefill"), pair.url("decode"), extra_ports,
                                  {**os.environ, "P2PKV_SECRET": pair.secret}, log_dir, time.monotonic())
    except BaseException:
        pair.stop()
        raise

    def stop() -> None:
        stop_children(extra)
        extra.clear()
        pair.stop()

    return StartedGroup([first, *started], stop)
