"""One side of a P/D pair in a pod: what ``p2pkv launch prefill|decode`` checks and runs.

:func:`prepare` validates a :class:`PodOptions` and builds the engine's
command line and environment without starting anything; the flags are in
:mod:`p2pkv.tools.deploy.pod_cli` and :func:`p2pkv.tools.deploy.supervise.supervise`
runs the engine.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from p2pkv.tools.deploy import checks
from p2pkv.tools.deploy.engines import EngineSpec, fit_to_cpu
from p2pkv.tools.deploy.processes import LaunchError

DEFAULT_PORTS = {"prefill": 8100, "decode": 8200}
DEFAULT_SIDE_CHANNEL_PORT = 5600

_ENV_PREFIXES = ("P2PKV_", "UCX_", "NIXL_", "VLLM_", "CUDA_VISIBLE_DEVICES", "OMP_")
_SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "KEY")


@dataclass
class PodOptions:
    """What one pod-side engine is asked to be (flags with env fallbacks applied).

    Attributes:
        role: ``"prefill"`` or ``"decode"``.
        model: model directory.
        host: HTTP bind address.
        port: HTTP port.
        side_channel_host: side-channel address as given (None: pick the pod IP).
        side_channel_host_flag: where it came from, for messages.
        side_channel_port: side-channel base port; tp_rank r of pipeline stage s uses
            port + s * tensor_parallel_size + r.
        port_flag / side_channel_port_flag: where the ports came from.
        tensor_parallel_size: TP size.
        pipeline_parallel_size: pipeline stages (a prefill engine's only).
        gpu_ids: ``"0,1"`` or None.
        block_size: tokens per KV block.
        dtype: model dtype (``auto``: the model's).
        max_model_len: longest sequence in tokens (None: the model's).
        extra_config: more ``kv_connector_extra_config`` keys.
        extra_args: more ``vllm serve`` flags, appended.
        proxy_url: the proxy this engine is meant for (checked, printed).
        log_dir: where the engine log goes.
    """

    role: str
    model: str
    host: str = "0.0.0.0"
    port: int = 8100
    side_channel_host: str | None = None
    side_channel_host_flag: str = "--side-channel-host"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    port_flag: str = "--port"
    side_channel_port_flag: str = "--side-channel-port"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_ids: str | None = None
    block_size: int = 32
    dtype: str = "auto"
    max_model_len: int | None = None
    extra_config: dict[str, object] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    proxy_url: str | None = None
    log_dir: Path = Path(".p2pkv/logs")


@dataclass
class PodPlan:
    """A validated engine, ready to start.

    Attributes:
        spec: the engine.
        env: its full environment.
        shown_env: the part of it worth printing (secrets hidden).
        side_channel_reason: why this side-channel address was chosen.
        health_url: where readiness is polled.
        advertised: ``host:port`` other nodes reach the HTTP server at.
        proxy_url: as given, checked.
        warnings: things that work here but not across nodes.
    """

    spec: EngineSpec
    env: dict[str, str]
    shown_env: dict[str, str]
    side_channel_reason: str
    health_url: str
    advertised: str
    proxy_url: str | None = None
    warnings: list[str] = field(default_factory=list)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _shown_env(env: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    shown = {k: v for k, v in env.items() if base.get(k) != v or k.startswith(_ENV_PREFIXES)}
    return {k: ("<hidden>" if any(w in k.upper() for w in _SECRET_WORDS) else v) for k, v in sorted(shown.items())}


def _check_secret(extra_config: dict[str, object], environ: dict[str, str]) -> None:
    """A side-channel secret is configured (flag, file or ``P2PKV_SECRET``) and long enough, or ``--insecure``
    says none is wanted.

    Raises:
        LaunchError: neither, a secret file that cannot be read, or a secret shorter than
            :data:`p2pkv.config.MIN_SECRET_BYTES`; names the fixes.
    """
    from p2pkv.config import ConfigError, load_config

    try:
        if load_config(extra_config, environ).require_secret() is None:
            print("warning: --insecure: the side channel runs without a secret; anyone who reaches its port can "
                  "read this engine's KV cache", file=sys.stderr, flush=True)
    except ConfigError as exc:
        raise LaunchError(f"--secret-file / P2PKV_SECRET: {exc}") from exc


def prepare(opts: PodOptions) -> PodPlan:
    """Validate everything and build the engine; starts nothing.

    Checks, in order: the model directory, the pipeline stages against the
    role (only a prefill engine runs PP), the GPUs against TP x PP, the block
    size, the side-channel address (``POD_IP`` or the outward interface by
    default, never loopback), the HTTP port and every worker rank's
    side-channel port, and ``--proxy-url``. The engine inherits this
    process's environment.

    Raises:
        LaunchError: the first failed check; the message names the flag and the fix.
    """
    environ = dict(os.environ)
    if not Path(opts.model).is_dir():
        raise LaunchError(f"--model {opts.model}: no such directory; pass the model directory "
                          "(for a test, make one with `p2pkv make-tiny-model DIR`)")
    _check_secret(opts.extra_config, environ)
    pp = opts.pipeline_parallel_size
    if pp < 1:
        raise LaunchError(f"--pipeline-parallel-size={pp}: must be >= 1")
    if pp > 1 and opts.role != "prefill":
        raise LaunchError(f"--pipeline-parallel-size={pp} with launch {opts.role}: p2pkv runs pipeline stages on "
                          "a prefill engine only (a decode engine's ranks each hold every layer); use "
                          "--pipeline-parallel-size 1 here, or TP / DP for the decode engine")
    gpus = checks.plan_gpus(opts.tensor_parallel_size, opts.gpu_ids, environ, pipeline_parallel_size=pp)
    checks.check_block_size(opts.block_size, gpus.available > 0)
    if opts.max_model_len is not None and opts.max_model_len <= 0:
        raise LaunchError(f"--max-model-len={opts.max_model_len}: must be > 0 tokens")
    if opts.side_channel_host is None:
        sc_host, reason = checks.default_side_channel_host(environ)
    else:
        flag = opts.side_channel_host_flag
        sc_host = checks.resolve_local_address(opts.side_channel_host, flag)
        reason = f"from {flag}" + (f" ({opts.side_channel_host} resolves to it)" if sc_host != opts.side_channel_host
                                   else "")
    warnings = []
    if checks.is_unroutable(sc_host):
        warnings.append(f"side channel on {sc_host} ({reason}): peers get this address as is, so only engines "
                        "on this machine can pull from it; give the pod IP for a pair across nodes")
    checks.check_port_free(opts.host, opts.port, opts.port_flag)
    tp = opts.tensor_parallel_size
    ranks = tp * pp
    scp = opts.side_channel_port
    checks.check_port_run(sc_host, scp, ranks, opts.side_channel_port_flag)
    if scp <= opts.port < scp + ranks:
        raise LaunchError(f"{opts.port_flag}={opts.port} collides with the side-channel ports {scp}.."
                          f"{scp + ranks - 1} ({opts.side_channel_port_flag}); pick ports that differ")
    proxy_url = checks.check_proxy_url(opts.proxy_url) if opts.proxy_url else None
    engine_env = {} if gpus.visible_devices is None else {"CUDA_VISIBLE_DEVICES": gpus.visible_devices}
    spec = EngineSpec(name=opts.role, model=opts.model, port=opts.port, host=opts.host, role=opts.role,
                      side_channel_host=sc_host, side_channel_port=scp, block_size=opts.block_size,
                      dtype=opts.dtype, max_model_len=opts.max_model_len, tensor_parallel_size=tp,
                      pipeline_parallel_size=pp,
                      extra_config=dict(opts.extra_config), env=engine_env, extra_args=opts.extra_args,
                      enforce_eager=gpus.available == 0, local_defaults=gpus.available == 0)
    if gpus.available == 0:
        spec = fit_to_cpu(spec)  # the CPU-dependent flags (an MLA model's backend), each logged
    wildcard = opts.host in ("", "0.0.0.0", "::")
    local = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(opts.host, opts.host)
    env = spec.environment()
    return PodPlan(spec=spec, env=env, shown_env=_shown_env(env, environ), side_channel_reason=reason,
                   health_url=f"http://{_url_host(local)}:{opts.port}/health",
                   advertised=f"{_url_host(sc_host if wildcard else opts.host)}:{opts.port}",
                   proxy_url=proxy_url, warnings=warnings)


def shown_command(spec: EngineSpec) -> str:
    """The engine's command line, shell-quoted (it holds no secret: :func:`p2pkv.config.load_config` refuses
    ``secret`` in ``kv_connector_extra_config``; the secret travels as ``P2PKV_SECRET`` or ``secret_file``)."""
    return shlex.join(spec.command())


def describe(plan: PodPlan) -> list[str]:
    """What the launcher prints before starting: side channel, env, command."""
    spec = plan.spec
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    rule = "port + tp_rank" if pp == 1 else f"port + pp_rank * {tp} + tp_rank"
    ports = str(spec.side_channel_port) if tp * pp == 1 else \
        f"{spec.side_channel_port}..{spec.side_channel_port + tp * pp - 1} ({rule})"
    lines = [f"side channel: {_url_host(spec.side_channel_host)}:{ports} ({plan.side_channel_reason})"]
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append("env:")
    lines += [f"  {k}={shlex.quote(v)}" for k, v in plan.shown_env.items()]
    lines.append(f"command: {shown_command(spec)}")
    flag = f"--{spec.role}"
    if plan.proxy_url:
        lines.append(f"proxy: {plan.proxy_url} must list this engine: p2pkv proxy ... {flag} {plan.advertised}")
    else:
        lines.append(f"proxy: list this engine as `p2pkv proxy ... {flag} {plan.advertised}`")
    return lines
