"""A local prefill/decode pair plus the bundled proxy (and optionally an aggregated engine)."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2pkv.tools.deploy.checks import check_port_free
from p2pkv.tools.deploy.engines import EngineSpec, fit_to_cpu
from p2pkv.tools.deploy.pod_cli import parse_extra_args, parse_extra_config
from p2pkv.tools.deploy.processes import Child, LaunchError, start_child, stop_children, wait_healthy


@dataclass
class LocalPair:
    """Prefill + decode engines with p2pkv and the proxy in front, on one host.

    Attributes:
        model: model directory.
        host: address everything binds to.
        prefill_port / decode_port / proxy_port: HTTP ports.
        side_channel_port: prefill side-channel base port; decode uses +100.
        aggregated_port: when set, also start one plain engine (no connector)
            on this port, for comparisons.
        block_size: tokens per KV block (a multiple of 32 on CPU).
        dtype: model dtype.
        log_dir: where each process writes ``<name>.log``.
        extra_config: more ``kv_connector_extra_config`` keys for both engines.
        decode_extra_config: keys for the decode engine only.
        decode_load_failure_policy: the decode engine's vLLM ``kv_load_failure_policy`` (``recompute`` or
            ``fail``; None: vLLM's default, ``fail``).
        env: more environment variables for every engine (e.g. p2pkv's fault knobs, :mod:`p2pkv.faults`).
        connector: ``"p2pkv"`` or ``"nixl"`` (vLLM's NixlConnector, for comparisons).
        tensor_parallel_size: TP size of every engine.
        engine_args: more ``vllm serve`` flags for every engine.
        proxy_args: more ``p2pkv proxy`` flags (e.g. ``--first-token-from decode``).
        secret: the side-channel secret the two engines and the proxy share
            (``P2PKV_SECRET`` in their environments; a fresh random one when empty).
        otlp_traces_endpoint: when set, the proxy, both engines' p2pkv spans and vLLM's own request
            spans export there over OTLP/HTTP (docs/tracing.md): the proxy and vLLM by their
            ``--otlp-traces-endpoint`` flags, p2pkv by ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` in the
            engines' environments.
    """

    model: str
    host: str = "127.0.0.1"
    prefill_port: int = 8100
    decode_port: int = 8200
    proxy_port: int = 8000
    side_channel_port: int = 5600
    aggregated_port: int | None = None
    block_size: int = 32
    dtype: str = "float32"
    max_model_len: int = 2048
    log_dir: Path = Path(".p2pkv/logs")
    extra_config: dict[str, object] = field(default_factory=dict)
    decode_extra_config: dict[str, object] = field(default_factory=dict)
    decode_load_failure_policy: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    connector: str = "p2pkv"
    tensor_parallel_size: int = 1
    engine_args: tuple[str, ...] = ()
    proxy_args: tuple[str, ...] = ()
    children: list[Child] = field(default_factory=list)
    secret: str = ""
    otlp_traces_endpoint: str = ""

    def __post_init__(self) -> None:
        if not self.secret:
            self.secret = os.environ.get("P2PKV_SECRET") or secrets.token_hex(16)

    def _gpu_share(self) -> float | None:
        """On a GPU machine the engines share its memory (vLLM's default would let the first take 90 %)."""
        import torch

        if not torch.cuda.is_available():
            return None
        return round(0.85 / (3 if self.aggregated_port is not None else 2), 2)

    def engine_specs(self) -> list[EngineSpec]:
        """The engines this pair starts, fitted to this machine's CPU (:func:`fit_to_cpu`: it logs each choice)."""
        env = {"UCX_NET_DEVICES": "lo", **self.env, "P2PKV_SECRET": self.secret}
        engine_args, extra = tuple(self.engine_args), dict(self.extra_config)
        if self.otlp_traces_endpoint:
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"  # vLLM's own exporter (grpc otherwise)
            engine_args += ("--otlp-traces-endpoint", self.otlp_traces_endpoint)
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = self.otlp_traces_endpoint  # p2pkv's spans
        common = dict(model=self.model, host=self.host, block_size=self.block_size, dtype=self.dtype,
                      max_model_len=self.max_model_len, connector=self.connector,
                      side_channel_host=self.host, env=env,
                      tensor_parallel_size=self.tensor_parallel_size, extra_args=engine_args,
                      gpu_memory_utilization=self._gpu_share())
        specs = [
            EngineSpec(name="prefill", port=self.prefill_port, role="prefill",
                       side_channel_port=self.side_channel_port, extra_config=extra, **common),
            EngineSpec(name="decode", port=self.decode_port, role="decode",
                       side_channel_port=self.side_channel_port + 100,
                       extra_config={**extra, **self.decode_extra_config},
                       kv_load_failure_policy=self.decode_load_failure_policy, **common),
        ]
        if self.aggregated_port is not None:
            specs.append(EngineSpec(name="aggregated", port=self.aggregated_port, role=None, **common))
        return [fit_to_cpu(spec) for spec in specs]

    def proxy_command(self) -> list[str]:
        """The proxy argv."""
        return [sys.executable, "-m", "p2pkv.tools.proxy", "--host", self.host, "--port", str(self.proxy_port),
                "--prefill", f"{self.host}:{self.prefill_port}",
                "--decode", f"{self.host}:{self.decode_port}", *self.proxy_args,
                *(("--otlp-traces-endpoint", self.otlp_traces_endpoint) if self.otlp_traces_endpoint else ())]

    def check(self) -> None:
        """Validate before starting anything.

        Raises:
            LaunchError: missing model dir, a port in use, a bad block size, a
                secret shorter than :data:`p2pkv.config.MIN_SECRET_BYTES`, or
                a bad p2pkv setting (``secret`` among them) in the extra config.
        """
        from p2pkv.config import ConfigError, check_secret, load_config

        try:
            check_secret(self.secret.strip().encode(), "P2PKV_SECRET")
            if self.connector == "p2pkv":
                load_config({**self.extra_config, **self.decode_extra_config}, environ={})
        except ConfigError as exc:
            raise LaunchError(str(exc)) from exc
        if not Path(self.model).is_dir():
            raise LaunchError(f"--model {self.model}: no such directory; create it with "
                              "`p2pkv make-tiny-model` or pass a model directory")
        if self.block_size <= 0:
            raise LaunchError(f"--block-size={self.block_size} must be > 0")
        ports = {"--prefill-port": self.prefill_port, "--decode-port": self.decode_port,
                 "--proxy-port": self.proxy_port, "--side-channel-port": self.side_channel_port,
                 "--side-channel-port (+100, decode)": self.side_channel_port + 100}
        if self.aggregated_port is not None:
            ports["--aggregated-port"] = self.aggregated_port
        if len(set(ports.values())) != len(ports):
            raise LaunchError(f"ports must differ: {ports}")
        for flag, port in ports.items():
            check_port_free(self.host, port, flag)

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the engines, wait for their health, then start the proxy.

        Raises:
            LaunchError: a process died or never became healthy (all are stopped).
        """
        self.check()
        try:
            for spec in self.engine_specs():
                self.children.append(start_child(spec.name, spec.command(), spec.environment(),
                                                 self.log_dir, f"http://{spec.host}:{spec.port}/health"))
            wait_healthy(self.children, timeout_s)
            proxy = start_child("proxy", self.proxy_command(), {**os.environ, "P2PKV_SECRET": self.secret},
                                self.log_dir, f"http://{self.host}:{self.proxy_port}/health")
            self.children.append(proxy)
            wait_healthy([proxy], 60.0)
        except BaseException:
            self.stop()
            raise

    def dead_child(self) -> Child | None:
        """The first child that exited, if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        """Stop every process (idempotent)."""
        stop_children(self.children)
        self.children.clear()

    def url(self, name: str) -> str:
        """Base URL of ``proxy``, ``prefill``, ``decode`` or ``aggregated``."""
        port = {"proxy": self.proxy_port, "prefill": self.prefill_port,
                "decode": self.decode_port, "aggregated": self.aggregated_port}[name]
        return f"http://{self.host}:{port}"

    def __enter__(self) -> LocalPair:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(args: argparse.Namespace) -> int:
    """``p2pkv launch local``: start the pair and the proxy, print their commands, run until SIGTERM/SIGINT.

    Returns:
        0 when stopped by a signal; 1 when a process died or never became healthy.
    """
    try:
        pair = LocalPair(model=args.model, host=args.host, prefill_port=args.prefill_port,
                         decode_port=args.decode_port, proxy_port=args.proxy_port,
                         side_channel_port=args.side_channel_port, aggregated_port=args.aggregated_port,
                         block_size=args.block_size, dtype=args.dtype, max_model_len=args.max_model_len,
                         log_dir=Path(args.log_dir), extra_config=parse_extra_config(args.kv_connector_extra_config),
                         decode_extra_config=parse_extra_config(args.decode_extra_config, "--decode-extra-config"),
                         engine_args=parse_extra_args(args.extra_vllm_args),
                         proxy_args=parse_extra_args(args.proxy_args, "--proxy-args"),
                         otlp_traces_endpoint=args.otlp_traces_endpoint)
    except LaunchError as exc:
        print(f"p2pkv launch: {exc}", file=sys.stderr)
        return 2
    for spec in pair.engine_specs():
        print(f"[{spec.name}] {' '.join(spec.command())}")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        pair.start()
        print(f"ready: proxy on {pair.url('proxy')} (Ctrl-C stops everything)", flush=True)
        while (dead := pair.dead_child()) is None:
            time.sleep(1.0)
        print(f"{dead.name} exited with code {dead.proc.returncode}; log {dead.log_path}:\n{dead.tail()}",
              file=sys.stderr)
        return 1
    except LaunchError as exc:
        print(f"p2pkv launch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        pair.stop()
