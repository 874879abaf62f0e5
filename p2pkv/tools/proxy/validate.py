"""What the proxy accepts from a client: the body's size, its JSON types, the prompt count, and the request id.

Every field the proxy itself reads (in :mod:`p2pkv.tools.proxy.app`,
:mod:`~p2pkv.tools.proxy.batch` and :mod:`~p2pkv.tools.proxy.first_token`)
is checked here before any engine is asked, so a value of the wrong type is
a 400 naming the field, never a 500 or a request the two engines read
differently. Fields the proxy only passes on are left to the engines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.requests import Request

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest request body the proxy reads by default (bytes; ``--max-body-bytes``)."""
DEFAULT_MAX_PROMPTS = 256
"""Most prompts one completions request may carry by default (``--max-prompts``)."""
DEFAULT_MAX_FANOUT = 8
"""Most prefill/decode pairs one batched request runs at once by default (``--max-fanout``)."""

CLIENT_ID_CHARS = 64
"""How much of a client's ``X-Request-Id`` the proxy logs (characters)."""
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+=/-]")


class BadRequest(ValueError):
    """The client's request cannot be served; the message names the field and the fix.

    Args:
        message: what is wrong and how to fix it.
        param: the request field at fault (None: the body as a whole).
        status: the HTTP status for the client (400, or 413 for a body over the limit).
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def payload(self) -> dict[str, Any]:
        """The OpenAI-style error object sent to the client."""
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.status}}


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "stream": ("a boolean (true or false)", lambda v: isinstance(v, bool)),
    "return_token_ids": ("a boolean (true or false)", lambda v: isinstance(v, bool)),
    "max_tokens": ("an integer", _is_int),
    "max_completion_tokens": ("an integer", _is_int),
    "min_tokens": ("an integer", _is_int),
    "n": ("an integer", _is_int),
    "best_of": ("an integer", _is_int),
    "seed": ("an integer", _is_int),
    "temperature": ("a number", _is_number),
    "stream_options": ("an object", lambda v: isinstance(v, dict)),
    "kv_transfer_params": ("an object", lambda v: isinstance(v, dict)),
}
"""Top-level fields the proxy reads: what each must be when present and not null."""
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def _expect(param: str, value: Any, kind: str) -> BadRequest:
    shown = json.dumps(value)[:40]
    return BadRequest(f"{param} must be {kind}, got {_json_type(value)} {shown}; fix the request", param)


def _prompt_count(prompt: Any) -> int:
    """How many prompts ``prompt`` holds.

    Raises:
        BadRequest: not a string, a list of strings, a list of token ids or a
            list of token-id lists, or an empty list.
    """
    if prompt is None or isinstance(prompt, str):
        return 1
    kind = "a string, a list of strings, a list of token ids (integers) or a list of token-id lists"
    if not isinstance(prompt, list):
        raise _expect("prompt", prompt, kind)
    if not prompt:
        raise BadRequest("prompt is an empty list; send at least one prompt", "prompt")
    if all(_is_int(p) for p in prompt):
        return 1
    if all(isinstance(p, str) for p in prompt):
        return len(prompt)
    if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
        return len(prompt)
    raise BadRequest(f"prompt must be {kind}; this list mixes types or nests deeper; fix the request", "prompt")


def check_request(path: str, body: Any, max_prompts: int = DEFAULT_MAX_PROMPTS) -> None:
    """Refuse a request the proxy cannot read, or one a P/D pair cannot serve as one engine would.

    Args:
        path: ``/v1/completions`` or ``/v1/chat/completions``.
        body: the parsed JSON body.
        max_prompts: most prompts a completions request may carry.

    Raises:
        BadRequest: the body is not an object; a field the proxy reads has the
            wrong type (``stream``, ``prompt``, ``messages``, ``max_tokens``,
            ``n``, ``stream_options``, ...); ``n`` or ``best_of`` above 1
            (several sequences per prompt would each need the prompt's KV on
            the decode side); more than ``max_prompts`` prompts. The message
            names the field and the fix.
    """
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {_json_type(body)}")
    for name, (kind, ok) in _CHECKS.items():
        value = body.get(name)
        if value is not None and not ok(value):
            raise _expect(name, value, kind)
    for name in _STREAM_OPTIONS:
        value = (body.get("stream_options") or {}).get(name)
        if value is not None and not isinstance(value, bool):
            raise _expect(f"stream_options.{name}", value, "a boolean (true or false)")
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and value != 1:
            raise BadRequest(f"{name}={value!r} is not supported through the P/D proxy (each prompt is prefilled "
                             f"once and decoded once); send {name}=1, or several requests", name)
    if path == CHAT:
        messages = body.get("messages")
        if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise _expect("messages", messages, "an array of message objects")
    elif path == COMPLETIONS and (count := _prompt_count(body.get("prompt"))) > max_prompts:
        raise BadRequest(f"prompt holds {count} prompts, more than this proxy's --max-prompts {max_prompts}; "
                         "split the batch into several requests (or raise --max-prompts)", "prompt")


async def read_json(request: Request, max_body_bytes: int) -> Any:
    """The request's JSON body, read no further than ``max_body_bytes``.

    ``Content-Length`` is checked before anything is read; a chunked body is
    counted while it streams in, and reading stops at the limit.

    Raises:
        BadRequest: 413 for a body over ``max_body_bytes`` (names the limit
            and ``--max-body-bytes``); 400 for a bad ``Content-Length`` or a
            body that is not JSON.
    """
    too_large = BadRequest(f"request body is larger than {max_body_bytes} bytes, this proxy's --max-body-bytes; "
                           "send a smaller request (or raise --max-body-bytes)", status=413)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise BadRequest(f"Content-Length {declared[:40]!r} is not a byte count")
        if int(declared) > max_body_bytes:
            raise too_large
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > max_body_bytes:
            raise too_large
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise BadRequest(f"request body is not JSON ({type(exc).__name__}); send a JSON object") from exc


def client_request_id(value: str | None) -> str | None:
    """A client's ``X-Request-Id`` fit for a log line: at most :data:`CLIENT_ID_CHARS` characters, characters
    outside ``[A-Za-z0-9._:@+=/-]`` replaced by ``?`` (None when absent). Never sent to an engine."""
    if not value:
        return None
    shown = _UNSAFE.sub("?", value[:CLIENT_ID_CHARS])
    return shown + "?..." if len(value) > CLIENT_ID_CHARS else shown
