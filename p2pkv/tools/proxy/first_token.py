"""The first token straight from the prefill engine: streamed to the client at once, decode continues after it.

Without it a streaming client's first token waits for both legs: the prefill
round trip, then the decode engine's pull and first step. The prefill engine
has already sampled that token (its one-token answer), so the proxy sends it
to the client as soon as the prefill answer arrives, then asks the decode
engine to continue from the prompt plus that token (``appended_tokens`` in
``kv_transfer_params``: the decode engine loads the prompt's KV and computes
the appended token itself) and relays its stream from the second token on,
rewritten so the client sees one engine's stream: one id, ``usage`` counted
against the client's prompt, the decode engine's own role chunk dropped.

Greedy output is the same token for token (the prefill engine's first token
is the aggregated engine's; the decode engine's next step is the aggregated
engine's second). Requests whose output would differ fall back to the plain
path (the decode engine samples the first token again), decided before the
prefill request (:func:`blocker`) and after its answer (:func:`read_first_token`).
vLLM PR #51919 proposes the same hand-over inside vLLM; SGLang's router sends
the prefill's first token with the KV.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from p2pkv.params import SENDER, with_appended_tokens
from p2pkv.tools.proxy.validate import CHAT, COMPLETIONS

FirstTokenSource = Literal["prefill", "decode"]
"""Where a streaming request's first token comes from: the prefill engine's answer, or the decode engine."""


class Fallback(str, Enum):
    """Why a streaming request's first token came from the decode engine, not the prefill engine's answer
    (the ``reason`` of ``p2pkv_proxy_first_token_fallbacks_total``)."""

    CONFIG = "config"
    """The proxy runs with ``--first-token-from decode``."""
    REQUEST = "request"
    """The request's shape (:func:`blocker`): several prompts, non-text chat content, or a field that changes
    what a continuation after one token produces (:data:`BLOCKING_FIELDS`)."""
    SAMPLING = "sampling"
    """Random sampling whose first draw the decode engine would not repeat: seeded in pull and push mode (the
    continuation would restart the seed's generator), unseeded in stream mode (each engine draws its own)."""
    PREFILL_ANSWER = "prefill_answer"
    """The prefill answer has no usable token: not a p2pkv prefill engine's, ``first_token`` false (an
    attention-window model), no single choice with one token id and the prompt's ids, or (stream mode) the
    prefill leg failed."""
    PARSER = "parser"
    """A chat answer went through a reasoning or tool parser."""
    FINISH_REASON = "finish_reason"
    """The prefill answer ended for another reason than ``stop`` or the request's own ``max_tokens`` 1."""
    PARTIAL_CHARACTER = "partial_character"
    """The token's text is empty or holds U+FFFD while the answer goes on: part of a character, which the decode
    engine's detokenizer would not continue as one engine's does."""
    DECODE_FIRST = "decode_first"
    """Stream mode: the decode engine's first token came before the prefill answer."""


def request_fallback(path: str, body: dict[str, Any], first_token_from: FirstTokenSource) -> Fallback | None:
    """Why a streaming request takes its first token from the decode engine before any leg is sent (None: the
    prefill engine's may go): the proxy's ``first_token_from``, else :func:`blocker`'s reason."""
    if first_token_from == "decode":
        return Fallback.CONFIG
    reason = blocker(path, body)
    if reason is None:
        return None
    return Fallback.SAMPLING if reason == "seeded sampling" else Fallback.REQUEST

BLOCKING_FIELDS: tuple[str, ...] = (
    "echo", "suffix", "prompt_logprobs", "stop", "frequency_penalty",
    "presence_penalty", "min_tokens", "bad_words", "truncate_prompt_tokens", "prompt_embeds", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools",
    "return_prompt_text",
)
"""Request fields that keep the first token on the decode engine when set (not None, false, 0 or empty).

Each changes what a continuation from the prompt plus one token produces:
stop strings may span the first two tokens, frequency/presence penalties and
``min_tokens`` count output tokens, structured output and tool parsing need
the first token as output, prompt logprobs and ``echo`` are not rebuilt by the proxy,
prompt truncation would cut the appended token.
"""


def blocker(path: str, body: dict[str, Any]) -> str | None:
    """Why a request must take its first token from the decode engine (None: the prefill engine's may go).

    Only single-prompt streaming completions and chat completions qualify
    (a non-streaming client sees nothing before the end anyway). Seeded
    sampling keeps the plain path, so a seeded request stays reproducible
    and equal to one engine's (vLLM's per-request generator would start
    afresh on the decode engine for the second token).
    """
    if body.get("stream") is not True:
        return "not streamed"
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        token_ids = isinstance(prompt, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
        if isinstance(prompt, list) and not token_ids and len(prompt) != 1:
            return "several prompts"
    elif path == CHAT:
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                return "non-text message content"
    else:
        return "not a completions or chat completions request"
    for name in BLOCKING_FIELDS:
        if body.get(name) not in (None, False, 0, "", [], {}):
            return name
    if body.get("seed") is not None and body.get("temperature") != 0:
        return "seeded sampling"
    return None


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(frozen=True)
class FirstToken:
    """The prefill engine's sampled token, as the client's first output token.

    Attributes:
        token_id: its token id.
        text: its text (completions ``text``, chat ``content``).
        finish_reason: ``"stop"`` or ``"length"`` when the answer ends with
            it (end of sequence, a stop token id, or ``max_tokens`` 1); None
            when the decode engine continues.
        stop_reason: the prefill answer's ``stop_reason`` (a stop token id), if any.
        prompt_token_ids: the prompt as the prefill engine tokenized it (tokens).
        logprobs: the prefill answer's logprobs of the token (vLLM's
            completions or chat format), or None when not asked for.
        id: the prefill answer's id, used for every chunk of the stream.
        created: its creation time (Unix seconds).
        model: the served model name.
    """

    token_id: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_token_ids: list[int]
    logprobs: dict[str, Any] | None
    id: str
    created: int
    model: str


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def read_first_token(path: str, body: dict[str, Any], answer: dict[str, Any]) -> FirstToken | None:
    """The first token from a prefill engine's answer (asked with ``return_token_ids``), or None to fall back
    (:func:`first_token_or_fallback` says why)."""
    first = first_token_or_fallback(path, body, answer)
    return first if isinstance(first, FirstToken) else None


def first_token_or_fallback(path: str, body: dict[str, Any], answer: dict[str, Any]) -> FirstToken | Fallback:
    """The first token from a prefill engine's answer (asked with ``return_token_ids``), or why not.

    Falls back (:class:`Fallback`) when the prefill engine is not p2pkv's or
    says its token is not the first output token (``first_token`` false: an
    attention-window model computes all but the prompt's last token there),
    when the answer lacks token ids, a chat answer went through a reasoning
    or tool parser, the answer ended for another reason than ``stop`` or
    ``max_tokens`` 1, or its text is empty or holds U+FFFD while the answer
    goes on (the token is part of a character: vLLM's detokenizer on the
    decode engine would not continue it as one engine's does).
    """
    params = answer.get("kv_transfer_params") or {}
    if params.get("kv_connector") != SENDER or params.get("first_token") is not True:
        return Fallback.PREFILL_ANSWER
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return Fallback.PREFILL_ANSWER
    choice = choices[0]
    token_ids = _int_list(choice.get("token_ids"))
    prompt_ids = _int_list(choice.get("prompt_token_ids") if path == COMPLETIONS else answer.get("prompt_token_ids"))
    if token_ids is None or len(token_ids) != 1 or prompt_ids is None:
        return Fallback.PREFILL_ANSWER
    if path == COMPLETIONS:
        text = choice.get("text")
    else:
        message = choice.get("message") or {}
        if message.get("tool_calls") or message.get("reasoning") or message.get("reasoning_content"):
            return Fallback.PARSER
        text = message.get("content")
    finish = choice.get("finish_reason")
    if finish == "length":
        finish = "length" if _max_tokens(body) == 1 else None
    elif finish != "stop":
        return Fallback.FINISH_REASON
    if not isinstance(text, str) or "\ufffd" in text or (not text and finish is None):
        return Fallback.PARTIAL_CHARACTER  # the decode engine's text would not continue it as one engine's does
    return FirstToken(token_id=token_ids[0], text=text, finish_reason=finish, stop_reason=choice.get("stop_reason"),
                      prompt_token_ids=prompt_ids, logprobs=choice.get("logprobs") or None,
                      id=str(answer.get("id") or ""),
                      created=int(answer.get("created") or 0), model=str(answer.get("model") or ""))


def decode_body(path: str, body: dict[str, Any], first: FirstToken, params: dict[str, Any],
                secret: bytes | None = None) -> dict[str, Any]:
    """The decode engine's request: continue after ``first``.

    The prompt becomes the prefill prompt's token ids plus ``first.token_id``
    (completions: ``prompt``; chat: ``kv_transfer_params.prompt_token_ids``,
    which vLLM uses instead of rendering ``messages``), ``max_tokens`` one
    less, and ``kv_transfer_params.appended_tokens`` 1, signed again with
    ``secret`` (the capability covers it: :func:`p2pkv.params.with_appended_tokens`).
    """
    return _continued(path, body, first, with_appended_tokens(params, 1, secret))


def recompute_body(path: str, body: dict[str, Any], first: FirstToken) -> dict[str, Any]:
    """The decode engine's request to continue after ``first`` with no KV to load: the prompt's token ids plus
    ``first.token_id`` (completions: ``prompt``; chat: ``kv_transfer_params.prompt_token_ids`` alone, no
    transfer), ``max_tokens`` one less, no ``seed`` (its generator's first draw made the first token: drawing it
    again for the next would tie the two). The engine computes the prompt itself; with prefix caching on (vLLM's
    default) the blocks a layer stream of the same prompt just loaded there are reused."""
    out = _continued(path, body, first, {})
    out.pop("seed", None)
    return out


def _continued(path: str, body: dict[str, Any], first: FirstToken, kv: dict[str, Any]) -> dict[str, Any]:
    """``body`` continuing after ``first``: its prompt's token ids plus ``first.token_id`` (completions:
    ``prompt``; chat: ``kv["prompt_token_ids"]``), ``kv`` as its ``kv_transfer_params`` (none when empty),
    ``max_tokens`` one less."""
    out = dict(body)
    ids = [*first.prompt_token_ids, first.token_id]
    if path == COMPLETIONS:
        out["prompt"] = ids
    else:
        kv = {**kv, "prompt_token_ids": ids}
    out.pop("kv_transfer_params", None)
    if kv:
        out["kv_transfer_params"] = kv
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(out.get(name), int):
            out[name] -= 1
    return out


def sse_event(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying ``obj`` (JSON, or a string such as ``[DONE]`` as it is)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class FirstTokenStream:
    """Builds the client's stream: the first token's chunks, then the decode engine's chunks rewritten.

    Chunks follow vLLM's streaming format for the endpoint (a chat stream
    opens with a role chunk; ``return_token_ids`` puts ``prompt_token_ids``
    in the first chunk and ``token_ids`` in each; ``stream_options``
    ``include_usage`` ends with a usage chunk, ``continuous_usage_stats``
    adds usage to every chunk).

    Args:
        path: ``/v1/completions`` or ``/v1/chat/completions``.
        body: the client's request.
        first: the prefill engine's first token.
        continued: the decode engine continues after ``first`` (its prompt
            ends with it: usage and completions ``text_offset`` are moved by
            one token); False when its stream starts at the client's prompt
            (layer-streamed: :mod:`p2pkv.tools.proxy.stream_hand_over`).
    """

    def __init__(self, path: str, body: dict[str, Any], first: FirstToken, continued: bool = True) -> None:
        self.chat = path == CHAT
        self.first = first
        self.continued = continued
        self.token_ids = body.get("return_token_ids") is True
        options = body.get("stream_options") or {}
        self.usage = isinstance(options, dict) and options.get("include_usage") is True
        self.continuous = self.usage and options.get("continuous_usage_stats") is True
        self.prompt_tokens = len(first.prompt_token_ids)
        self.usage_chunk: dict[str, Any] | None = None
        """The decode engine's final usage chunk (rewritten), kept for :meth:`closing`."""

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _chunk(self, choice: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.first.id, "object": "chat.completion.chunk" if self.chat else
                                 "text_completion", "created": self.first.created, "model": self.first.model,
                                 "choices": [choice]}
        if self.continuous:
            chunk["usage"] = self._usage(completion_tokens)
        return chunk

    def opening(self) -> bytes:
        """The chunks of the first token (and the end of the stream when it is the last)."""
        first = self.first
        out = b""
        finish = {"finish_reason": first.finish_reason}
        if first.finish_reason is not None:
            finish["stop_reason"] = first.stop_reason
        ids = {"token_ids": [first.token_id]} if self.token_ids else {}
        if self.chat:
            role = self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}, 0)
            if self.token_ids:
                role["prompt_token_ids"] = first.prompt_token_ids
            out += sse_event(role)
            out += sse_event(self._chunk({"index": 0, "delta": {"content": first.text}, "logprobs": first.logprobs,
                                       **finish, **ids}, 1))
        else:
            choice: dict[str, Any] = {"index": 0, "text": first.text, "logprobs": first.logprobs, **finish}
            if self.token_ids:
                choice = {**choice, "prompt_token_ids": first.prompt_token_ids, **ids}
            out += sse_event(self._chunk(choice, 1))
        if first.finish_reason is not None:
            out += self.closing(None)
        return out

    def closing(self, usage_chunk: dict[str, Any] | None) -> bytes:
        """The usage chunk (when asked for) and ``[DONE]``; ``usage_chunk`` is the decode engine's, rewritten."""
        out = b""
        if self.usage:
            out += sse_event(usage_chunk or {**self._chunk({}, 1), "choices": [], "usage": self._usage(1)})
        return out + sse_event("[DONE]")

    def _count(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The decode engine's usage counted against the client's prompt: one token moves to the output (none when
        its stream started at that prompt)."""
        out = dict(usage)
        if not self.continued:
            return out
        if isinstance(out.get("prompt_tokens"), int) and isinstance(out.get("completion_tokens"), int):
            out["prompt_tokens"] = self.prompt_tokens
            out["completion_tokens"] += 1
            out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out

    def _shift_offsets(self, logprobs: Any) -> None:
        """Completions logprobs' ``text_offset`` counts from the decode engine's first output character;
        the client's text starts with the first token's."""
        if not self.continued or self.chat:
            return
        if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
            logprobs["text_offset"] = [o + len(self.first.text) if isinstance(o, int) else o
                                       for o in logprobs["text_offset"]]

    def rewrite(self, data: str) -> bytes | None:
        """The bytes to send for one ``data:`` payload of the decode engine's stream (None: nothing).

        ``[DONE]`` and the usage chunk come out of :meth:`closing`, sent by the
        caller at the end of the decode stream.
        """
        if data == "[DONE]":
            return None
        try:
            obj = json.loads(data)
        except ValueError:
            return sse_event(data)
        if not isinstance(obj, dict):
            return sse_event(data)
        out = self.rewrite_chunk(obj)
        return None if out is None else sse_event(out)

    def rewrite_chunk(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """One parsed chunk of the decode engine's stream rewritten (None: not sent; a usage-only chunk is kept
        for :meth:`closing`); an error object passes unchanged."""
        if "error" in obj:
            return obj
        obj.pop("prompt_token_ids", None)
        obj["id"], obj["created"] = self.first.id, self.first.created
        if isinstance(obj.get("usage"), dict):
            obj["usage"] = self._count(obj["usage"])
        choices = obj.get("choices")
        if not choices:
            if obj.get("usage") is not None:
                self.usage_chunk = obj
            return None
        for choice in choices:
            if isinstance(choice, dict):
                choice.pop("prompt_token_ids", None)
                self._shift_offsets(choice.get("logprobs"))
                delta = choice.get("delta")
                if (self.chat and isinstance(delta, dict) and "role" in delta and not delta.get("content")
                        and choice.get("finish_reason") is None):
                    return None  # the decode engine's own opening role chunk: ours went first
        return obj
