"""Multi-turn reuse through the proxy (docs/multi-turn.md): the params of a conversation's last kept turn, found
again by its next turn's prompt.

A decode engine with ``keep_turns_s`` answers a whole (not streamed) request with ``kv_transfer_params`` naming the
blocks it kept (:func:`p2pkv.turns.make_turn_params`). The proxy remembers them under what the conversation's next
turn starts with, and sends them with that turn's prefill leg, whose engine then loads those blocks instead of
computing them again:

- completions: the prompt and the answer's text (a string prompt), or their token ids (a prompt of token ids, the
  answer's ``token_ids``); a later prompt that starts with them finds them (the longest such);
- chat completions: the messages and the answer as the assistant's message (role and text); a later request whose
  messages but the last are those finds them.

Keys are SHA-256 digests, with the request's ``model`` and ``cache_salt`` (a tenant's), never the text. Params are
used once (an engine binds a capability to one request) and forgotten when they expire or past
:data:`MAX_TURNS` (the least recently remembered first). A turn that finds none, or whose kept blocks are gone,
just prefills: the engines check everything again (the tokens' digest, the capability), so a wrong guess here costs
nothing but the lookup.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from p2pkv.tools.proxy.upstream import UpstreamError
from p2pkv.turns import wants_turn_load

__all__ = ["MAX_TURNS", "TurnMemory"]

log = logging.getLogger("p2pkv.tools.proxy")

MAX_TURNS = 1024
"""Most conversations whose last turn's params the proxy keeps at once."""

Key = tuple[str, int, str]
"""``(kind, length, digest)``: what a stored turn is found by (``length``: characters, tokens or messages)."""


def _hasher(kind: str, scope: tuple[Any, ...]) -> Any:
    """A SHA-256 of ``kind`` and ``scope``, to be fed the conversation (:func:`_chunk`)."""
    return hashlib.sha256(json.dumps([kind, *scope], separators=(",", ":")).encode() + b"\0")


def _chunk(kind: str, items: Any) -> bytes:
    """Bytes of a run of a conversation: characters (UTF-8), token ids (8 bytes each), or ``[role, text]`` messages
    (JSON, one per line): the bytes of a prefix are a prefix of the whole's."""
    if kind == "text":
        return items.encode()
    if kind == "ids":
        return b"".join(int(t).to_bytes(8, "little", signed=True) for t in items)
    return b"".join(json.dumps(m, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" for m in items)


def _digest(kind: str, scope: tuple[Any, ...], items: Any) -> str:
    hasher = _hasher(kind, scope)
    hasher.update(_chunk(kind, items))
    return hasher.hexdigest()


def _prefix_digests(kind: str, scope: tuple[Any, ...], items: Any, lengths: list[int]) -> dict[int, str]:
    """:func:`_digest` of ``items[:n]`` for each ``n`` of ``lengths``, in one pass over ``items``."""
    hasher, at, out = _hasher(kind, scope), 0, {}
    for n in sorted(lengths):
        hasher.update(_chunk(kind, items[at:n]))
        at = n
        out[n] = hasher.copy().hexdigest()
    return out


def _scope(body: dict[str, Any]) -> tuple[Any, ...]:
    """What keeps conversations apart besides their text: the model and the tenant's ``cache_salt``."""
    return str(body.get("model", "")), str(body.get("cache_salt", ""))


def _messages(messages: list[Any]) -> list[list[str]] | None:
    """Chat messages as ``[role, text]`` pairs (None: a message that is not plain text)."""
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return None
        out.append([str(message.get("role", "")), message["content"]])
    return out


class TurnMemory:
    """The kept turns' params, by conversation (bounded; see the module docstring).

    Args:
        clock: seconds since the Unix epoch (the params' ``remote_blocks_expiry_time``).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._turns: OrderedDict[Key, dict[str, Any]] = OrderedDict()
        self._lengths: dict[str, Counter[int]] = {"text": Counter(), "ids": Counter(), "chat": Counter()}
        self._clock = clock
        self.found = 0

    def __len__(self) -> int:
        return len(self._turns)

    def remember(self, path: str, body: dict[str, Any], answer: dict[str, Any]) -> bool:
        """Keep the params of ``answer`` (a decode engine's whole answer to ``body``) for the next turn.

        Returns:
            True when they were kept: the answer names blocks kept for a next turn and its prompt and text are of
            a kind this memory keys.
        """
        params = answer.get("kv_transfer_params")
        choices = answer.get("choices")
        if not wants_turn_load(params) or not isinstance(choices, list) or len(choices) != 1:
            return False
        choice = choices[0] if isinstance(choices[0], dict) else {}
        key = self._answer_key(path, body, choice)
        if key is None:
            return False
        self._drop(key)
        self._turns[key] = dict(params)  # type: ignore[arg-type]
        self._lengths[key[0]][key[1]] += 1
        while len(self._turns) > MAX_TURNS:
            self._drop(next(iter(self._turns)))
        return True

    def _drop(self, key: Key) -> dict[str, Any] | None:
        """Forget ``key``'s params (returned; None: none)."""
        params = self._turns.pop(key, None)
        if params is not None:
            lengths = self._lengths[key[0]]
            lengths[key[1]] -= 1
            if not lengths[key[1]]:
                del lengths[key[1]]
        return params

    def remember_body(self, path: str, body: dict[str, Any], content: bytes) -> bool:
        """:meth:`remember` of a decode engine's answer as it came (``content``: its JSON bytes; anything else is
        not remembered)."""
        if b"kv_transfer_params" not in content:
            return False
        try:
            answer = json.loads(content)
        except ValueError:
            return False
        return isinstance(answer, dict) and self.remember(path, body, answer)

    def take(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The params of the longest kept turn ``body``'s prompt extends (forgotten here: they serve one request),
        or None."""
        now = self._clock()
        for key in self._request_keys(path, body):
            params = self._drop(key)
            if params is None:
                continue
            if _expired(params, now):
                continue
            self.found += 1
            return params
        return None

    async def prefill(self, path: str, body: dict[str, Any],
                      send: Callable[[dict[str, Any] | None], Awaitable[dict[str, Any]]],
                      count: Callable[[str], Any]) -> dict[str, Any]:
        """``body``'s prefill leg, sent by ``send`` with the params of the conversation's last kept turn
        (:meth:`take`; ``send(None)``: none). A leg that fails with them (the decode engine that kept the turn is
        gone or restarted, or its hold ended: the prefill engine's load fails, and vLLM fails the request under
        ``kv_load_failure_policy`` fail) is sent once more without them: its engine computes the whole prompt.

        Args:
            send: sends the leg with these turn params (or none); returns the prefill engine's answer.
            count: the proxy's ``p2pkv_proxy_turns_total`` series of an event (``sent``, ``failed``).

        Raises:
            UpstreamError: the leg failed without a turn's params (or again without them).
        """
        turn = self.take(path, body)
        if turn is None:
            return await send(None)
        count("sent").inc()
        try:
            return await send(turn)
        except UpstreamError as exc:
            count("failed").inc()
            log.warning("a prefill leg loading a kept turn from decode engine %s failed (%s); sending it again "
                        "without the turn: its engine computes the whole prompt", turn.get("remote_engine_id"), exc)
            return await send(None)

    def has(self, path: str, body: dict[str, Any]) -> bool:
        """Whether :meth:`take` would find a kept turn for ``body`` now (nothing is forgotten here)."""
        now = self._clock()
        for key in self._request_keys(path, body):
            params = self._turns.get(key)
            if params is not None and not _expired(params, now):
                return True
        return False

    def remember_answer(self, path: str, body: dict[str, Any], status_code: int, content: Any,
                        count: Callable[[str], Any]) -> None:
        """:meth:`remember_body` of a decode leg's answer to ``body`` as the proxy relays it (``content``: its
        bytes; None for a streamed answer, which names no turn); ``count("kept")`` when remembered."""
        if status_code == 200 and isinstance(content, bytes) and self.remember_body(path, body, content):
            count("kept").inc()

    def _answer_key(self, path: str, body: dict[str, Any], choice: dict[str, Any]) -> Key | None:
        """The key the next turn of ``body`` answered with ``choice`` finds it by (None: not keyed)."""
        scope = _scope(body)
        if path == "/v1/chat/completions":
            messages = _messages(body.get("messages") or [])
            reply = choice.get("message")
            if messages is None or not isinstance(reply, dict) or not isinstance(reply.get("content"), str):
                return None
            history = [*messages, ["assistant", reply["content"]]]
            return "chat", len(history), _digest("chat", scope, history)
        prompt, text, ids = body.get("prompt"), choice.get("text"), choice.get("token_ids")
        if isinstance(prompt, str) and isinstance(text, str):
            return "text", len(prompt + text), _digest("text", scope, prompt + text)
        if _token_ids(prompt) and _token_ids(ids):
            tokens = [*prompt, *ids]
            return "ids", len(tokens), _digest("ids", scope, tokens)
        return None

    def _request_keys(self, path: str, body: dict[str, Any]) -> list[Key]:
        """The keys ``body`` may extend, longest first."""
        scope = _scope(body)
        if path == "/v1/chat/completions":
            messages = _messages(body.get("messages") or [])
            if not messages or len(messages) - 1 not in self._lengths["chat"]:
                return []
            return [("chat", len(messages) - 1, _digest("chat", scope, messages[:-1]))]
        prompt = body.get("prompt")
        kind = "text" if isinstance(prompt, str) else "ids" if _token_ids(prompt) else ""
        if not kind:
            return []
        lengths = [n for n in self._lengths[kind] if n < len(prompt)]
        digests = _prefix_digests(kind, scope, prompt, lengths)
        return [(kind, n, digests[n]) for n in sorted(lengths, reverse=True)]


def _expired(params: dict[str, Any], now: float) -> bool:
    """Whether kept-turn ``params`` have expired at ``now`` (seconds since the Unix epoch)."""
    expiry = params.get("remote_blocks_expiry_time")
    return isinstance(expiry, int | float) and expiry <= now


def _token_ids(value: Any) -> bool:
    """A non-empty list of token ids."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)
