"""``p2pkv proxy``: command-line flags and the uvicorn server."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from p2pkv.tools.proxy.validate import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FANOUT, DEFAULT_MAX_PROMPTS

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
                        help="the engines' side-channel secret (default: env P2PKV_SECRET; one of them is "
                             "required unless --insecure), used to free a prefill engine's blocks at once when "
                             "their decode leg fails")
    parser.add_argument("--insecure", action="store_true",
                        help="start without a side-channel secret: a prefill hold whose decode leg failed then "
                             "waits for its lease instead of being freed at once")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                        help=f"largest request body read; a larger one is answered 413 (default "
                             f"{DEFAULT_MAX_BODY_BYTES}, 16 MiB)")
    parser.add_argument("--max-fanout", type=int, default=DEFAULT_MAX_FANOUT, metavar="N",
                        help="most prefill/decode pairs a completions request with a list of prompts runs at once "
                             f"(default {DEFAULT_MAX_FANOUT})")
    parser.add_argument("--max-prompts", type=int, default=DEFAULT_MAX_PROMPTS, metavar="N",
                        help=f"most prompts one completions request may carry; more is answered 400 (default "
                             f"{DEFAULT_MAX_PROMPTS})")
    parser.add_argument("--first-token-from", choices=("prefill", "decode"), default="prefill",
                        help="where a streaming request's first token comes from: 'prefill' (default) sends the "
                             "prefill engine's sampled token at once and lets the decode engine continue after it, "
                             "for requests whose output stays the same (greedy or unseeded sampling, no stop "
                             "strings, prompt logprobs, penalties on output, structured output or tools); 'decode' "
                             "waits for the decode engine's first token (use it with engines running a reasoning or "
                             "tool parser)")
    parser.add_argument("--transfer-mode", choices=("pull", "push", "stream"), default="",
                        help="ask every decode engine for this direction (kv_transfer_params.p2pkv_transfer_mode): "
                             "'pull' (the decode engine READs) or 'push' (the prefill engine WRITEs into the decode "
                             "engine's blocks) or 'stream' (both legs at once, the prefill engine WRITEs each layer "
                             "as it computes it; single prompts, once a prefill engine has answered once; needs the "
                             "secret); default: each decode engine's transfer_mode setting (auto); see docs/push.md "
                             "and docs/streaming.md")
    parser.add_argument("--seed-streamed-sampling", action="store_true",
                        help="with --transfer-mode stream: draw a seed for both legs of a streaming request that "
                             "samples at random without one, so that its first token comes from the prefill engine "
                             "(greedy and seeded requests get it anyway); off by default because vLLM then samples "
                             "the request's batch on its per-request generator path (on CUDA without FlashInfer's "
                             "top-k/top-p sampler); see docs/streaming.md")
    parser.add_argument("--otlp-traces-endpoint", default="", metavar="URL",
                        help="send OpenTelemetry traces (one per request: the proxy's span, each leg's, and the "
                             "engines' under them) over OTLP/HTTP to URL, e.g. http://127.0.0.1:4318/v1/traces "
                             "(default: env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + "
                             "/v1/traces, else off); see docs/tracing.md")


def read_secret(secret_file: str | None, insecure: bool) -> bytes | None:
    """The side-channel secret: ``--secret-file``'s contents, else ``P2PKV_SECRET`` (both stripped).

    Returns:
        The secret, or None only with ``insecure``.

    Raises:
        ValueError: the file cannot be read; no secret without ``insecure``
            (names both fixes); a secret shorter than
            :data:`p2pkv.config.MIN_SECRET_BYTES` (names how to make one).
    """
    from p2pkv.config import ConfigError, check_secret

    source, secret = "P2PKV_SECRET", os.environ.get("P2PKV_SECRET", "").strip().encode()
    if secret_file:
        source = f"--secret-file {secret_file}"
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{source}: {exc}") from exc
    if not secret:
        if insecure:
            return None
        raise ValueError(f"no side-channel secret ({source} is empty): set P2PKV_SECRET or pass --secret-file PATH "
                         "(the engines' secret: the proxy frees a prefill hold whose decode leg failed with it); or "
                         "pass --insecure to start without one (such holds then wait for their lease)")
    try:
        return check_secret(secret, source)
    except ConfigError as exc:
        raise ValueError(str(exc)) from exc


def main(args: argparse.Namespace) -> int:
    """Run the proxy until interrupted; returns the exit code (2 on bad flags or a missing secret)."""
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
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-fanout", args.max_fanout),
                        ("--max-prompts", args.max_prompts)):
        if value < 1:
            print(f"p2pkv proxy: {flag} {value}: must be >= 1", file=sys.stderr)
            return 2
    try:
        secret = read_secret(args.secret_file, args.insecure)
    except ValueError as exc:
        print(f"p2pkv proxy: {exc}", file=sys.stderr)
        return 2
    if secret is None:
        print("p2pkv proxy: warning: --insecure: no side-channel secret; a prefill hold whose decode leg failed "
              "waits for its lease", file=sys.stderr, flush=True)
    from p2pkv.telemetry.tracing import traces_endpoint

    endpoint = traces_endpoint(args.otlp_traces_endpoint)
    if endpoint and not endpoint.startswith(("http://", "https://")):
        print(f"p2pkv proxy: traces endpoint {endpoint!r}: expected an http:// or https:// URL (OTLP/HTTP, e.g. "
              "http://127.0.0.1:4318/v1/traces)", file=sys.stderr)
        return 2
    # INFO: each request whose client sent an X-Request-Id logs it next to the proxy's own id
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("p2pkv.tools.proxy").setLevel(logging.INFO)
    try:
        app = create_app(prefill, decode, timeout_s=args.timeout, secret=secret,
                         first_token_from=args.first_token_from, max_body_bytes=args.max_body_bytes,
                         max_fanout=args.max_fanout, max_prompts=args.max_prompts, otlp_traces_endpoint=endpoint,
                         transfer_mode=args.transfer_mode, seed_streams=args.seed_streamed_sampling)
    except ImportError as exc:
        print(f"p2pkv proxy: tracing to {endpoint} needs the OpenTelemetry SDK and its OTLP/HTTP exporter ({exc}): "
              "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http", file=sys.stderr)
        return 2
    if endpoint:
        print(f"p2pkv proxy: sending traces to {endpoint} (service.name p2pkv-proxy)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
