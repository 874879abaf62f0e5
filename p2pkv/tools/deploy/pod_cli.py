"""The flags of ``p2pkv launch prefill|decode`` (with ``P2PKV_*`` fallbacks) and its entry point."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from p2pkv.tools.deploy.pod import DEFAULT_PORTS, DEFAULT_SIDE_CHANNEL_PORT, PodOptions, PodPlan, describe, prepare
from p2pkv.tools.deploy.processes import LaunchError

#: ``vllm serve`` flags the launcher sets and checks itself → the launcher flag to use instead.
_OWN_FLAGS = {"--model": "--model", "--host": "--host", "--port": "--port",
              "--tensor-parallel-size": "--tensor-parallel-size", "-tp": "--tensor-parallel-size",
              "--pipeline-parallel-size": "--pipeline-parallel-size", "-pp": "--pipeline-parallel-size",
              "--block-size": "--block-size", "--dtype": "--dtype", "--max-model-len": "--max-model-len",
              "--kv-transfer-config": "--kv-connector-extra-config"}


def add_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """The flags of ``p2pkv launch prefill|decode`` (env fallbacks are applied in :func:`options_from_args`)."""
    p = parser.add_argument
    p("--model", metavar="DIR", help="model directory (env P2PKV_MODEL)")
    p("--host", default="0.0.0.0", metavar="ADDR", help="HTTP bind address (default 0.0.0.0)")
    p("--port", type=int, help=f"HTTP port (env P2PKV_PORT; default {DEFAULT_PORTS[role]})")
    p("--side-channel-host", metavar="ADDR", help="address the side channel binds to and advertises to peers "
      "(env P2PKV_SIDE_CHANNEL_HOST; default: POD_IP, else the outward interface's address)")
    p("--side-channel-port", type=int, metavar="PORT", help="side-channel base port; tp_rank r of pipeline stage s "
      "uses port + s*TP + r, so TP N x PP M needs N*M consecutive free ports (env P2PKV_SIDE_CHANNEL_PORT; default "
      f"{DEFAULT_SIDE_CHANNEL_PORT})")
    p("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N", help="TP size (1 without CUDA)")
    p("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
      help="pipeline stages (prefill engines only)")
    p("--gpu-ids", metavar="IDS", help="GPUs for the engine, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES)")
    p("--block-size", type=int, default=32, metavar="TOKENS",
      help="tokens per KV block (a multiple of 32 without CUDA)")
    p("--dtype", default="auto", help="model dtype (auto: the model's)")
    p("--max-model-len", type=int, metavar="TOKENS", help="longest sequence in tokens (default: the model's)")
    p("--kv-connector-extra-config", default="{}", metavar="JSON", help="more p2pkv settings, merged")
    p("--secret-file", metavar="PATH", help="file holding the side-channel secret shared by prefill, decode and the "
      "proxy (a mounted Secret; default: env P2PKV_SECRET; one of them is required)")
    p("--insecure", action="store_true", help="run the side channel without a secret (anyone who reaches its port "
      "can read the KV cache): for a closed test network only")
    p("--extra-vllm-args", default="", metavar="ARGS",
      help="more `vllm serve` flags in one shell-split string: --extra-vllm-args='--flag value'")
    p("--proxy-url", metavar="URL", help="the proxy this engine serves (checked and printed, e.g. http://10.0.0.9:8000)")
    p("--log-dir", default=".p2pkv/logs", metavar="DIR", help=f"engine log goes to LOG_DIR/{role}.log")
    p("--no-echo", action="store_true", help="do not copy the engine log to stdout")
    p("--ready-timeout", type=float, default=1200.0, metavar="SECONDS", help="how long to wait for /health")
    p("--dry-run", action="store_true", help="validate, print the command and env, start nothing")


def _int_env(environ: dict[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise LaunchError(f"{name}={raw}: not an integer port") from exc


def parse_extra_config(text: str, flag: str = "--kv-connector-extra-config") -> dict[str, object]:
    """``flag``'s JSON object of p2pkv settings, checked as the engine will check it.

    Raises:
        LaunchError: not JSON, not an object, a side-channel key (it has its own flag), or a bad setting.
    """
    from p2pkv.config import ConfigError, load_config

    try:
        extra = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise LaunchError(f"{flag}: not JSON ({exc}); pass an object such as '{{\"lease_s\": 60}}'") from exc
    if not isinstance(extra, dict):
        raise LaunchError(f"{flag}: expected a JSON object, got {type(extra).__name__}")
    for key in ("side_channel_host", "side_channel_port"):
        if key in extra:
            raise LaunchError(f"{flag}: set {key} with --{key.replace('_', '-')} instead (it is checked there)")
    try:
        load_config(extra, environ={})
    except ConfigError as exc:
        raise LaunchError(f"{flag}: {exc}") from exc
    return extra


def parse_extra_args(text: str, flag: str = "--extra-vllm-args") -> tuple[str, ...]:
    """``flag``'s more command-line flags, shell-split (``--extra-vllm-args``: ``vllm serve`` flags).

    Raises:
        LaunchError: the text does not split, or (``--extra-vllm-args``) names a flag the launcher sets itself.
    """
    try:
        args = tuple(shlex.split(text))
    except ValueError as exc:
        raise LaunchError(f"{flag}: cannot split {text!r} ({exc}); check the quotes") from exc
    for arg in args if flag == "--extra-vllm-args" else ():
        own = _OWN_FLAGS.get(arg.split("=", 1)[0])
        if own is not None:
            raise LaunchError(f"{flag}: {arg.split('=', 1)[0]} is set by the launcher; use {own}")
    return args


def options_from_args(args: argparse.Namespace) -> PodOptions:
    """Flags → :class:`PodOptions`, with ``P2PKV_MODEL``, ``P2PKV_PORT``,
    ``P2PKV_SIDE_CHANNEL_HOST`` and ``P2PKV_SIDE_CHANNEL_PORT`` as fallbacks.

    Raises:
        LaunchError: no model, a non-integer port variable, bad JSON or extra args.
    """
    environ = dict(os.environ)
    role = args.mode
    model = args.model or environ.get("P2PKV_MODEL", "").strip()
    if not model:
        raise LaunchError("--model: required; pass the model directory or set P2PKV_MODEL")
    opts = PodOptions(role=role, model=model, host=args.host, port=DEFAULT_PORTS[role],
                      tensor_parallel_size=args.tensor_parallel_size,
                      pipeline_parallel_size=args.pipeline_parallel_size, gpu_ids=args.gpu_ids,
                      block_size=args.block_size, dtype=args.dtype, max_model_len=args.max_model_len,
                      extra_config=parse_extra_config(args.kv_connector_extra_config),
                      extra_args=parse_extra_args(args.extra_vllm_args), proxy_url=args.proxy_url,
                      log_dir=Path(args.log_dir))
    if args.secret_file:
        opts.extra_config["secret_file"] = str(Path(args.secret_file).resolve())
    if args.insecure:
        opts.extra_config["insecure"] = True
    if args.port is not None:
        opts.port = args.port
    elif (port := _int_env(environ, "P2PKV_PORT")) is not None:
        opts.port, opts.port_flag = port, "P2PKV_PORT"
    if args.side_channel_port is not None:
        opts.side_channel_port = args.side_channel_port
    elif (port := _int_env(environ, "P2PKV_SIDE_CHANNEL_PORT")) is not None:
        opts.side_channel_port, opts.side_channel_port_flag = port, "P2PKV_SIDE_CHANNEL_PORT"
    if args.side_channel_host:
        opts.side_channel_host = args.side_channel_host
    elif environ.get("P2PKV_SIDE_CHANNEL_HOST", "").strip():
        opts.side_channel_host = environ["P2PKV_SIDE_CHANNEL_HOST"].strip()
        opts.side_channel_host_flag = "P2PKV_SIDE_CHANNEL_HOST"
    return opts


def _check_proxy(plan: PodPlan) -> None:
    import httpx

    print(f"serving: other nodes reach this {plan.spec.role} engine at {plan.advertised}", flush=True)
    if not plan.proxy_url:
        return
    try:
        code = httpx.get(f"{plan.proxy_url}/health", timeout=3.0).status_code
        print(f"proxy {plan.proxy_url}: GET /health answered {code}", flush=True)
    except httpx.HTTPError as exc:
        print(f"warning: proxy {plan.proxy_url} not reachable yet ({exc})", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    """``p2pkv launch prefill|decode``.

    Returns:
        0 after ``--dry-run`` or once SIGTERM/SIGINT stopped the engine; 1
        when the engine exits or never becomes healthy; 2 when a check
        fails before anything starts (the message names the flag).
    """
    from p2pkv.tools.deploy.supervise import supervise

    try:
        opts = options_from_args(args)
        plan = prepare(opts)
    except LaunchError as exc:
        print(f"p2pkv launch {args.mode}: {exc}", file=sys.stderr)
        return 2
    for line in describe(plan):
        print(line, flush=True)
    if args.dry_run:
        print("dry run: checks passed, nothing started", flush=True)
        return 0
    return supervise(plan.spec.name, plan.spec.command(), plan.env, opts.log_dir, plan.health_url,
                     args.ready_timeout, on_ready=lambda _child: _check_proxy(plan),
                     echo=None if args.no_echo else sys.stdout)
