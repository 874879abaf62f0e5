"""The ``p2pkv`` command: ``demo``, ``launch``, ``proxy``, ``make-tiny-model``, ``bench``, ``trace``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _cmd_demo(args: argparse.Namespace) -> int:
    from p2pkv.tools.demo import run_demo

    return run_demo(Path(args.workdir), max_tokens=args.max_tokens, base_port=args.base_port)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from p2pkv.tools.tiny_model import TinyModelSpec, make_tiny_model, write_secret

    spec = TinyModelSpec(num_layers=args.layers, hidden_size=args.hidden_size, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, intermediate_size=args.intermediate_size,
                         max_position_embeddings=args.max_position_embeddings, seed=args.seed, kind=args.kind,
                         sliding_window=args.sliding_window)
    print(make_tiny_model(args.out, spec))
    if args.secret_file:
        print(write_secret(Path(args.secret_file)))
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from p2pkv.tools.deploy.local import main

    return main(args)


def _cmd_launch_pod(args: argparse.Namespace) -> int:
    from p2pkv.tools.deploy.pod_cli import main

    return main(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from p2pkv.tools.doctor import main

    return main(args.side_channel_host, args.side_channel_port, args.seconds, args.json)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from p2pkv.tools.proxy.proxy_cli import main

    return main(args)


def _cmd_trace(args: argparse.Namespace) -> int:
    from p2pkv.tools.trace.trace_cli import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``p2pkv`` command."""
    parser = argparse.ArgumentParser(prog="p2pkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_and_model(sub)
    _add_launch(sub)
    _add_doctor_and_proxy(sub)
    _add_bench(sub)
    _add_trace(sub)
    return parser


def _add_demo_and_model(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="local P/D pair + proxy answering prompts, checked against one engine")
    demo.add_argument("--workdir", default=".p2pkv", help="model, logs and stats go here")
    demo.add_argument("--max-tokens", type=int, default=16)
    demo.add_argument("--base-port", type=int, default=8000,
                      help="proxy port; prefill, decode, aggregated use +100, +200, +300")
    demo.set_defaults(func=_cmd_demo)

    from p2pkv.tools.tiny_model import KINDS, TinyModelSpec

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight model (Llama unless --kind)")
    tiny.add_argument("out", help="output directory")
    tiny.add_argument("--kind", choices=KINDS, default="llama",
                      help="llama; sliding-window (Mistral); interleaved-window (sliding-window and full layers "
                           "alternate); mla (DeepSeek-V2); hybrid (Granite-4: Mamba-2, attention)")
    tiny.add_argument("--layers", type=int, default=4)
    default = TinyModelSpec()
    tiny.add_argument("--hidden-size", type=int, default=default.hidden_size, help="model width (elements)")
    tiny.add_argument("--heads", type=int, default=default.num_heads,
                      help="attention heads (head_dim = hidden size / heads)")
    tiny.add_argument("--kv-heads", type=int, default=default.num_kv_heads, help="KV heads")
    tiny.add_argument("--intermediate-size", type=int, default=default.intermediate_size, help="MLP width")
    tiny.add_argument("--max-position-embeddings", type=int, default=default.max_position_embeddings,
                      help="longest sequence (tokens)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--sliding-window", type=int, default=40,
                      help="tokens, for --kind sliding-window / interleaved-window")
    tiny.add_argument("--secret-file", metavar="PATH",
                      help="also write a random side-channel secret here, unless the file already holds one")
    tiny.set_defaults(func=_cmd_make_tiny_model)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    launch_parser = sub.add_parser("launch", help="start a prefill/decode pair and the proxy, or one side of it")
    launch_sub = launch_parser.add_subparsers(dest="mode", required=True)
    launch = launch_sub.add_parser("local", help="both engines and the proxy on this host")
    launch.add_argument("--model", required=True, help="model directory")
    launch.add_argument("--host", default="127.0.0.1", help="address every engine, side channel and the proxy bind")
    launch.add_argument("--proxy-port", type=int, default=8000, help="the proxy's HTTP port: send prompts here")
    launch.add_argument("--prefill-port", type=int, default=8100, help="the prefill engine's HTTP port")
    launch.add_argument("--decode-port", type=int, default=8200, help="the decode engine's HTTP port")
    launch.add_argument("--side-channel-port", type=int, default=5600,
                        help="the prefill engine's first side-channel port, one per rank from there (the decode "
                             "engine's: 100 above)")
    launch.add_argument("--block-size", type=int, default=32, help="tokens per KV cache block, both engines")
    launch.add_argument("--dtype", default="float32", help="model dtype, both engines (float32, bfloat16, ...)")
    launch.add_argument("--log-dir", default=".p2pkv/logs", help="each process's log file goes here")
    launch.add_argument("--aggregated-port", type=int, default=None,
                        help="also start one plain engine (no connector) on this port, for comparisons")
    launch.add_argument("--max-model-len", type=int, default=2048, help="longest sequence (tokens)")
    launch.add_argument("--kv-connector-extra-config", default="{}", metavar="JSON",
                        help="more p2pkv settings for both engines")
    launch.add_argument("--decode-extra-config", default="{}", metavar="JSON",
                        help="more p2pkv settings for the decode engine only")
    launch.add_argument("--extra-vllm-args", default="", metavar="ARGS",
                        help="more `vllm serve` flags for every engine, in one shell-split string")
    launch.add_argument("--proxy-args", default="", metavar="ARGS",
                        help="more `p2pkv proxy` flags, in one shell-split string (e.g. '--transfer-mode push')")
    launch.add_argument("--otlp-traces-endpoint", default="", metavar="URL",
                        help="export the proxy's, p2pkv's and vLLM's spans there over OTLP/HTTP (docs/tracing.md)")
    launch.set_defaults(func=_cmd_launch)
    from p2pkv.tools.deploy.pod_cli import add_arguments as _add_pod_arguments

    for role in ("prefill", "decode"):
        side = launch_sub.add_parser(role, help=f"one {role} engine with p2pkv, for a pod (checks flags first)")
        _add_pod_arguments(side, role)
        side.set_defaults(func=_cmd_launch_pod)


def _add_doctor_and_proxy(sub: argparse._SubParsersAction) -> None:
    doctor = sub.add_parser("doctor", help="check NIXL/UCX, RDMA, GPU, the side-channel port, a loopback pull")
    doctor.add_argument("--side-channel-host", default="127.0.0.1")
    doctor.add_argument("--side-channel-port", type=int, default=5600)
    doctor.add_argument("--seconds", type=float, default=1.0, help="length of the loopback pull test")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_cmd_doctor)

    from p2pkv.tools.proxy.proxy_cli import add_arguments

    proxy = sub.add_parser("proxy", help="the OpenAI-compatible P/D proxy")
    add_arguments(proxy)
    proxy.set_defaults(func=_cmd_proxy)


BENCHES: tuple[tuple[str, str, str, str, str], ...] = (
    ("serve", "serving benchmark through the proxy: p2pkv vs NixlConnector vs one engine, answers checked",
     "p2pkv.tools.bench.serve", "add_arguments", "main"),
)
"""The ``p2pkv bench`` subcommands, in ``--help`` order: (name, help, module, the module's function adding the
options to a parser, the module's function running it from the parsed options and returning the exit code)."""


def _add_bench(sub: argparse._SubParsersAction) -> None:
    import importlib

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text, module_path, add_arguments, run in BENCHES:
        module = importlib.import_module(module_path)  # only when the parser is built, as the other commands
        parser = bench_sub.add_parser(name, help=help_text)
        getattr(module, add_arguments)(parser)
        parser.set_defaults(func=getattr(module, run))


def _add_trace(sub: argparse._SubParsersAction) -> None:
    from p2pkv.tools.trace.trace_cli import add_arguments

    trace = sub.add_parser("trace", help="draw one request's trace (from an OTLP/JSON file, or received over "
                                         "OTLP/HTTP) as a timeline PNG, with a text summary")
    add_arguments(trace)
    trace.set_defaults(func=_cmd_trace)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``p2pkv`` console script.

    The launchers' choices (``p2pkv.launch``: flags fitted to this machine's CPU) are logged to stderr.
    """
    args = build_parser().parse_args(argv)
    launch_log = logging.getLogger("p2pkv.launch")
    if not launch_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        launch_log.addHandler(handler)
        launch_log.setLevel(logging.INFO)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
