"""``p2pkv proxy``: command-line flags and the uvicorn server."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

_HOSTPORT = re.compile(r"^(?:(https?)://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):(\d{1,5})/?$")


def normalize_url(value: str, flag: str = "--prefill") -> str:
    """``"host:port"`` or ``"http://host:port"`` → ``"http://host:port"``.

    Raises:
        ValueError: not ``HOST:PORT`` or a port outside 1..65535; names ``flag``.
    """
    m = _HOSTPORT.match(value.strip())
    if not m or not 0 < int(m.group(3)) < 65536:
        raise ValueError(f"{flag} {value!r}: expected HOST:PORT (e.g. 127.0.0.1:8100)")
    return f"{m.group(1) or 'http'}://{m.group(2)}:{int(m.group(3))}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the proxy's flags to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="HOST:PORT",
                        help="prefill engines (round-robin)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="HOST:PORT",
                        help="decode engines (round-robin)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="timeout of each request to an engine, in seconds (default 300)")
    parser.add_argument("--secret-file", metavar="PATH",
                        help="the engines' side-channel secret (default: env P2PKV_SECRET), used to free a "
                             "prefill engine's blocks at once when their decode leg fails")
    parser.add_argument("--first-token-from", choices=("prefill", "decode"), default="prefill",
                        help="where a streaming request's first token comes from: 'prefill' (default) sends the "
                             "prefill engine's sampled token at once and lets the decode engine continue after it, "
                             "for requests whose output stays the same (greedy or unseeded sampling, no stop "
                             "strings, prompt logprobs, penalties on output, structured output or tools); 'decode' "
                             "waits for the decode engine's first token (use it with engines running a reasoning or "
                             "tool parser)")


def main(args: argparse.Namespace) -> int:
    """Run the proxy until interrupted; returns the exit code (2 on bad flags)."""
    import uvicorn

    from p2pkv.tools.proxy.app import create_app

    try:
        prefill = [normalize_url(v, "--prefill") for v in args.prefill]
        decode = [normalize_url(v, "--decode") for v in args.decode]
    except ValueError as exc:
        print(f"p2pkv proxy: {exc}", file=sys.stderr)
        return 2
    both = sorted(set(prefill) & set(decode))
    if both:
        print(f"p2pkv proxy: {', '.join(both)} is in both --prefill and --decode: a decode engine cannot pull from "
              "itself; give the two flags different engines", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"p2pkv proxy: --timeout {args.timeout}: must be > 0 seconds", file=sys.stderr)
        return 2
    secret = os.environ.get("P2PKV_SECRET", "").encode() or None
    if args.secret_file:
        try:
            secret = Path(args.secret_file).read_bytes().strip() or None
        except OSError as exc:
            print(f"p2pkv proxy: --secret-file {args.secret_file}: {exc}", file=sys.stderr)
            return 2
    app = create_app(prefill, decode, timeout_s=args.timeout, secret=secret, first_token_from=args.first_token_from)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
