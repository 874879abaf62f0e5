"""The ``p2pkv`` command: ``demo``, ``launch``, ``proxy``, ``make-tiny-model``, ``bench``."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path


def _cmd_demo(args: argparse.Namespace) -> int:
    from p2pkv.demo import run_demo

    return run_demo(Path(args.workdir), max_tokens=args.max_tokens, base_port=args.base_port)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from p2pkv.tiny_model import TinyModelSpec, make_tiny_model

    path = make_tiny_model(args.out, TinyModelSpec(num_layers=args.layers, seed=args.seed))
    print(path)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from p2pkv.deploy.local import LocalPair
    from p2pkv.deploy.processes import LaunchError

    pair = LocalPair(model=args.model, host=args.host, prefill_port=args.prefill_port,
                     decode_port=args.decode_port, proxy_port=args.proxy_port,
                     side_channel_port=args.side_channel_port, block_size=args.block_size,
                     dtype=args.dtype, log_dir=Path(args.log_dir))
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


def _cmd_launch_pod(args: argparse.Namespace) -> int:
    from p2pkv.deploy.pod_cli import main

    return main(args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from p2pkv.doctor import main

    return main(args.side_channel_host, args.side_channel_port, args.seconds, args.json)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from p2pkv.proxy.server import main

    return main(args)


def _token_list(text: str) -> tuple[int, ...]:
    """``"1024,4k,16k"`` → ``(1024, 4096, 16384)``."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return tuple(out)


def _add_bench_transfer_arguments(p: argparse.ArgumentParser) -> None:
    from p2pkv.bench.synth import ITEMSIZES
    from p2pkv.bench.transfer import DEVICES, ROLES, TransferBenchOptions

    d = TransferBenchOptions()
    p.add_argument("--layers", type=int, default=d.shape.num_layers, help="attention layers")
    p.add_argument("--kv-heads", type=int, default=d.shape.num_kv_heads, help="KV heads")
    p.add_argument("--head-dim", type=int, default=d.shape.head_dim, help="elements per head")
    p.add_argument("--dtype", default=d.shape.dtype, choices=list(ITEMSIZES), help="KV cache dtype")
    p.add_argument("--block-size", type=int, default=d.shape.block_size, help="tokens per block")
    p.add_argument("--num-blocks", type=int, default=0, help="blocks per cache (0: auto within --max-mem-gib)")
    p.add_argument("--requests", type=int, default=d.requests, help="timed requests per size and method")
    p.add_argument("--tokens", type=_token_list, default=d.tokens,
                   help="tokens per request, a comma-separated list (1024,4k,16k)")
    p.add_argument("--seed", type=int, default=d.seed, help="block placement seed")
    p.add_argument("--fragmentation", type=int, default=d.fragmentation, metavar="MAX_RUN",
                   help="longest run of consecutive block ids per allocation (1: all scattered, 0: contiguous)")
    p.add_argument("--progress-thread", action="store_true", help="NIXL progress thread on every agent")
    p.add_argument("--num-threads", type=int, default=0, help="UCX backend threads (0: NIXL default)")
    p.add_argument("--ucx-error-handling-mode", choices=["", "peer", "none"], default="",
                   help="UCX endpoint error handling ('': NIXL default)")
    p.add_argument("--ucx-num-workers", type=int, default=0, help="UCX workers per agent (0: NIXL default)")
    p.add_argument("--memcpy-threads", type=int, default=0, help="torch threads for memcpy (0: torch default)")
    p.add_argument("--max-mem-gib", type=float, default=d.max_mem_gib,
                   help="memory per process (GiB; GPU memory with --device cuda): two KV caches plus about 0.75 GiB")
    p.add_argument("--device", choices=list(DEVICES), default=d.device,
                   help="where the KV caches live: cpu (host memory, NIXL DRAM) or cuda (the current GPU, NIXL "
                        "VRAM; --role both: both processes on it, UCX cuda_ipc between them; memcpy is a "
                        "device-to-device copy)")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-exact check of one pull per method")
    p.add_argument("--host", default=d.host, help="side-channel address (--role prefill: also the control channel's)")
    p.add_argument("--role", choices=list(ROLES), default=d.role,
                   help="both: spawn the prefill process on this host (this process pulls); prefill: serve the "
                        "caches in the foreground until a decode says done; decode: pull from the prefill at --peer")
    p.add_argument("--peer", default=d.peer, metavar="HOST", help="--role decode: the prefill node's address")
    p.add_argument("--port", type=int, default=d.port,
                   help="split roles: side-channel port of the prefill's cross-layer cache, +1 for the "
                        "layer-compact one (--role both: ephemeral ports)")
    p.add_argument("--control-port", type=int, default=d.control_port,
                   help="split roles: TCP control channel port (readiness, block counts, done; 0: --port + 2)")
    p.add_argument("--serve-seconds", type=float, default=d.serve_seconds,
                   help="--role prefill: exit after this many seconds at the latest (exit code 1: no decode finished)")
    p.add_argument("--peer-timeout", type=float, default=d.peer_timeout_s,
                   help="--role decode: seconds to wait for the prefill at --peer to accept and answer")
    p.add_argument("--prefill-poll-ms", type=float, default=d.prefill_poll_ms,
                   help="how often the prefill process progresses NIXL without a progress thread (ms)")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--plot", metavar="PNG", help="write a plot here (needs matplotlib: p2pkv[bench])")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _cmd_bench_transfer(args: argparse.Namespace) -> int:
    from p2pkv.bench import report
    from p2pkv.bench.synth import KVShape
    from p2pkv.bench.transfer import PeerError, TransferBenchOptions, run_prefill, run_transfer_bench

    try:
        shape = KVShape(args.layers, args.kv_heads, args.head_dim, args.dtype, args.block_size)
        opts = TransferBenchOptions(
            shape=shape, tokens=tuple(args.tokens), requests=args.requests, num_blocks=args.num_blocks,
            seed=args.seed, fragmentation=args.fragmentation, progress_thread=args.progress_thread,
            num_threads=args.num_threads, ucx_error_handling_mode=args.ucx_error_handling_mode,
            ucx_num_workers=args.ucx_num_workers, memcpy_threads=args.memcpy_threads, max_mem_gib=args.max_mem_gib,
            device=args.device, verify=not args.no_verify, host=args.host, prefill_poll_ms=args.prefill_poll_ms,
            quiet=args.quiet, role=args.role, peer=args.peer, port=args.port, control_port=args.control_port,
            serve_seconds=args.serve_seconds, peer_timeout_s=args.peer_timeout)
        if opts.role == "prefill":
            return run_prefill(opts)
        result = run_transfer_bench(opts)
    except (ValueError, PeerError) as exc:
        print(f"p2pkv bench transfer: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 3
    print(report.format_table(result))
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and report.plot(result, args.plot):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(m["verified"] is not False for r in result["results"] for m in r["methods"].values()) else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``p2pkv`` command."""
    parser = argparse.ArgumentParser(prog="p2pkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="local P/D pair + proxy answering prompts, checked against one engine")
    demo.add_argument("--workdir", default=".p2pkv", help="model, logs and stats go here")
    demo.add_argument("--max-tokens", type=int, default=16)
    demo.add_argument("--base-port", type=int, default=8000,
                      help="proxy port; prefill, decode, aggregated use +100, +200, +300")
    demo.set_defaults(func=_cmd_demo)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight Llama model")
    tiny.add_argument("out", help="output directory")
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_make_tiny_model)

    launch_parser = sub.add_parser("launch", help="start a prefill/decode pair and the proxy, or one side of it")
    launch_sub = launch_parser.add_subparsers(dest="mode", required=True)
    launch = launch_sub.add_parser("local", help="both engines and the proxy on this host")
    launch.add_argument("--model", required=True, help="model directory")
    launch.add_argument("--host", default="127.0.0.1")
    launch.add_argument("--proxy-port", type=int, default=8000)
    launch.add_argument("--prefill-port", type=int, default=8100)
    launch.add_argument("--decode-port", type=int, default=8200)
    launch.add_argument("--side-channel-port", type=int, default=5600)
    launch.add_argument("--block-size", type=int, default=32)
    launch.add_argument("--dtype", default="float32")
    launch.add_argument("--log-dir", default=".p2pkv/logs")
    launch.set_defaults(func=_cmd_launch)
    from p2pkv.deploy.pod_cli import add_arguments as _add_pod_arguments

    for role in ("prefill", "decode"):
        side = launch_sub.add_parser(role, help=f"one {role} engine with p2pkv, for a pod (checks flags first)")
        _add_pod_arguments(side, role)
        side.set_defaults(func=_cmd_launch_pod)

    doctor = sub.add_parser("doctor", help="check NIXL/UCX, RDMA, GPU, the side-channel port, a loopback pull")
    doctor.add_argument("--side-channel-host", default="127.0.0.1")
    doctor.add_argument("--side-channel-port", type=int, default=5600)
    doctor.add_argument("--seconds", type=float, default=1.0, help="length of the loopback pull test")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_cmd_doctor)

    from p2pkv.proxy.server import add_arguments

    proxy = sub.add_parser("proxy", help="the OpenAI-compatible P/D proxy")
    add_arguments(proxy)
    proxy.set_defaults(func=_cmd_proxy)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    transfer = bench_sub.add_parser(
        "transfer", help="KV block pulls over NIXL between two processes vs memcpy (cross-layer vs per-layer)")
    _add_bench_transfer_arguments(transfer)
    transfer.set_defaults(func=_cmd_bench_transfer)
    from p2pkv.bench.serve import add_arguments as _add_bench_serve_arguments
    from p2pkv.bench.serve import main as _cmd_bench_serve

    serve = bench_sub.add_parser(
        "serve", help="serving benchmark through the proxy: p2pkv vs NixlConnector vs one engine, answers checked")
    _add_bench_serve_arguments(serve)
    serve.set_defaults(func=_cmd_bench_serve)
    from p2pkv.bench.fixup import add_arguments as _add_bench_fixup_arguments
    from p2pkv.bench.fixup import cli_main as _cmd_bench_fixup

    fixup = bench_sub.add_parser(
        "fixup", help="post-receive fixup (re-block, HND/NHD, head slice) on the device vs a plain copy")
    _add_bench_fixup_arguments(fixup)
    fixup.set_defaults(func=_cmd_bench_fixup)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``p2pkv`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
