"""``p2pkv trace``: flags, reading or receiving spans, and the PNG and text summary of one trace."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from p2pkv.tools.trace.otlp import SpanRecord

POLL_S = 0.2
"""How often ``--listen`` checks whether its time is up (seconds)."""


def parse_listen(value: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (IPv6 in brackets) → (host, port).

    Raises:
        ValueError: not ``HOST:PORT`` with a port in 0..65535.
    """
    host, sep, port = value.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--listen {value!r}: expected HOST:PORT (e.g. 127.0.0.1:4318)")
    return host, int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``p2pkv trace``'s flags to ``parser``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", metavar="PATH",
                        help="read spans from an OTLP/JSON file (one ExportTraceServiceRequest, a list of them, or "
                             "one per line as the OpenTelemetry Collector's file exporter writes)")
    source.add_argument("--listen", metavar="HOST:PORT",
                        help="receive spans over OTLP/HTTP (POST /v1/traces, protobuf or JSON) on HOST:PORT, e.g. "
                             "127.0.0.1:4318, until Ctrl-C or --seconds; point the exporters' traces endpoint at "
                             "http://HOST:PORT/v1/traces")
    parser.add_argument("--seconds", type=float, metavar="N", help="with --listen: stop after N seconds")
    parser.add_argument("--save", metavar="PATH", help="with --listen: also write every span received as OTLP/JSON")
    pick = parser.add_mutually_exclusive_group()
    pick.add_argument("--trace-id", metavar="HEX", help="draw this trace (32 hex digits)")
    pick.add_argument("--request-id", metavar="ID",
                      help="draw the trace with a span carrying this request id (the proxy's X-Request-Id, the "
                           "prefill engine's remote_request_id, the client's X-Request-Id or vLLM's request id); "
                           "default: the trace that started last")
    parser.add_argument("--out", default="trace.png", metavar="PATH", help="the timeline PNG (default trace.png)")


def _listen(host: str, port: int, seconds: float | None, save: str | None) -> list[SpanRecord]:
    """Receive until Ctrl-C or ``seconds``; the spans (saved to ``save`` when given).

    Raises:
        OSError: the address cannot be bound, or ``save`` cannot be written.
    """
    from p2pkv.tools.trace.otlp_receiver import OtlpReceiver

    with OtlpReceiver(host, port) as receiver:
        until = "Ctrl-C" if seconds is None else f"{seconds:g} s or Ctrl-C"
        print(f"p2pkv trace: receiving OTLP/HTTP traces at {receiver.url} until {until}", file=sys.stderr,
              flush=True)
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            while deadline is None or time.monotonic() < deadline:
                time.sleep(POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic())))
        except KeyboardInterrupt:
            pass
    spans = receiver.spans()
    print(f"p2pkv trace: {len(spans)} spans in {receiver.exports} exports", file=sys.stderr)
    if save:
        receiver.save(Path(save))
        print(f"p2pkv trace: saved them to {save}", file=sys.stderr)
    return spans


def main(args: argparse.Namespace) -> int:
    """Run ``p2pkv trace``; the exit code: 0 drawn, 1 no spans or no matching trace, 2 bad flags or input."""
    from p2pkv.tools.trace.timeline import layout, pick_trace, summary

    if args.file and (args.seconds is not None or args.save):
        print("p2pkv trace: --seconds and --save go with --listen", file=sys.stderr)
        return 2
    if args.seconds is not None and not args.seconds > 0:
        print(f"p2pkv trace: --seconds {args.seconds}: must be > 0", file=sys.stderr)
        return 2
    try:
        if args.file:
            from p2pkv.tools.trace.otlp import load, records_of

            spans = records_of(load(Path(args.file)))
        else:
            host, port = parse_listen(args.listen)
            spans = _listen(host, port, args.seconds, args.save)
    except (OSError, ValueError) as exc:
        print(f"p2pkv trace: {exc}", file=sys.stderr)
        return 2
    try:
        chosen = pick_trace(spans, args.trace_id, args.request_id)
    except LookupError as exc:
        print(f"p2pkv trace: {exc}", file=sys.stderr)
        return 1
    print(summary(chosen))
    try:
        from p2pkv.tools.trace.draw import draw

        draw(layout(chosen), Path(args.out))
    except ImportError as exc:
        print(f"p2pkv trace: drawing needs matplotlib ({exc}): pip install matplotlib", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"p2pkv trace: {args.out}: {exc}", file=sys.stderr)
        return 2
    print(f"p2pkv trace: wrote {args.out}", file=sys.stderr)
    return 0
