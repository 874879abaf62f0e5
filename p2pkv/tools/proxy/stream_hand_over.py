"""A layer-streamed request's first token from the prefill engine (``--transfer-mode stream``).

In stream mode both legs start at once (:mod:`p2pkv.tools.proxy.stream`), so
the decode engine is asked before any token exists and samples the first
token itself; it cannot be told to continue after the prefill engine's (the
continuation :mod:`p2pkv.tools.proxy.first_token` sends in pull and push
mode). The two engines sample the same first token when they draw it the
same way from the same logits (the same prompt KV and the same last step):
under greedy sampling (``temperature`` 0: the argmax), and under seeded
sampling (``seed``: vLLM seeds a generator per request, and the first token
is its first draw on both engines; the decode engine's next draws are then
the ones one engine makes). So the hand-over is made for streaming requests
that :func:`p2pkv.tools.proxy.first_token.blocker` lets through, greedy or
seeded, and checked:

- both legs are asked for token ids (``return_token_ids``);
- when the prefill leg answers before the decode engine's first event, its
  token goes to the client at once; the decode engine's stream follows with
  its first token removed (text, token id, logprobs), once that token's id
  is found equal to the one sent;
- a different id (float differences between the engines' batches can flip a
  near tie), or a decode stream that ends without a token, closes that stream
  and asks the same decode engine again to continue after the client's token
  with no KV to load (:func:`p2pkv.tools.proxy.hand_over.continue_after`; its
  prefix cache holds the blocks the stream just loaded), counted in
  ``p2pkv_proxy_first_token_mismatches_total``: the client's answer always
  continues its first token, never an error for it;
- when the decode engine's first event comes first, or the prefill answer
  carries no usable token (:func:`p2pkv.tools.proxy.first_token.first_token_or_fallback`),
  the decode engine's stream is relayed as it is.

Each streaming request whose first token comes from the decode engine is
counted with its reason in ``p2pkv_proxy_first_token_fallbacks_total``
(:class:`p2pkv.tools.proxy.first_token.Fallback`; ``decode_first`` for the race above).

Unseeded random sampling keeps the decode engine's first token, unless the
proxy runs with ``--seed-streamed-sampling``: it then draws a seed for both
legs of such a request (:func:`seeded`). That is not the default because a
seeded request makes vLLM sample its whole batch on the per-request
generator path, which on CUDA gives up FlashInfer's top-k/top-p sampler
(``vllm/v1/sample/ops/topk_topp_sampler.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi.responses import StreamingResponse

from p2pkv.tools.proxy.batch import sse_events
from p2pkv.tools.proxy.closing import ClosingStream
from p2pkv.tools.proxy.first_token import (
    Fallback,
    FirstToken,
    FirstTokenSource,
    FirstTokenStream,
    blocker,
    first_token_or_fallback,
    sse_event,
)
from p2pkv.tools.proxy.hand_over import DecodeLegs, broken_decode_stream, continue_after
from p2pkv.tools.proxy.proxy_spans import ProxySpan, RequestTrace, exemplar
from p2pkv.tools.proxy.stream_faults import (
    PrefillEnd,
    Recovery,
    answer_params,
    is_error_event,
    prefill_end,
    prefill_error,
)

logger = logging.getLogger(__name__)


def stream_blocker(path: str, body: dict[str, Any]) -> str | None:
    """Why a layer-streamed request takes its first token from the decode engine (None: the prefill engine's
    may go): :func:`p2pkv.tools.proxy.first_token.blocker`'s reasons but seeded sampling (both engines' first
    draw is the same here), and unseeded random sampling (``temperature`` not 0, or not given: vLLM's default
    may be a model's own)."""
    reason = blocker(path, body)
    if reason is not None and reason != "seeded sampling":
        return reason
    if body.get("seed") is not None and not isinstance(body.get("seed"), bool):
        return None
    temperature = body.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature != 0:
        return "not greedy"
    return None


def seeded(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a ``seed`` drawn for it (a random 31-bit int) when it samples at random without one: its
    legs' first tokens are then the same draw (``--seed-streamed-sampling``). Any other body as it is."""
    temperature = body.get("temperature")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0
    if greedy or body.get("seed") is not None:
        return body
    return {**body, "seed": secrets.randbelow(2**31)}


def hand_over_legs(path: str, body: dict[str, Any], seed: bool = False) -> dict[str, Any] | None:
    """The body both legs of a layer-streamed request get when the prefill engine's first token may go first:
    asked for token ids, and with ``seed`` (``--seed-streamed-sampling``) :func:`seeded`; None when the decode
    engine's first token goes (a request that is not streamed, or :func:`stream_blocker` gives a reason)."""
    if body.get("stream") is not True:
        return None
    sent = seeded(body) if seed else body
    if stream_blocker(path, sent) is not None:
        return None
    return {**sent, "return_token_ids": True}


def stream_fallback(path: str, body: dict[str, Any], seed: bool, first_token_from: FirstTokenSource) -> Fallback:
    """Why a streaming layer-streamed request whose legs :func:`hand_over_legs` left as they were (None) takes the
    decode engine's first token: the proxy's ``first_token_from``, unseeded random sampling, or its shape."""
    if first_token_from == "decode":
        return Fallback.CONFIG
    reason = stream_blocker(path, seeded(body) if seed else body)
    return Fallback.SAMPLING if reason == "not greedy" else Fallback.REQUEST


class FirstTokenMismatch(Exception):
    """The decode engine's first token differs from the prefill engine's, which the client already has (or its
    stream ended without one).

    Attributes:
        first: the token the client has.
    """

    def __init__(self, message: str, first: FirstToken) -> None:
        super().__init__(message)
        self.first = first

    @classmethod
    def differs(cls, sent: FirstToken, got: Any, what: str) -> FirstTokenMismatch:
        """The decode engine's first token has ``what`` ``got`` where ``sent`` has another."""
        return cls(f"the decode engine's first token ({what} {got!r}) differs from the prefill engine's "
                   f"(token id {sent.token_id}, text {sent.text!r}), which the client already has", sent)

    @classmethod
    def missing(cls, sent: FirstToken) -> FirstTokenMismatch:
        """The decode engine's stream ended without a token and without an error."""
        return cls(f"the decode engine's stream ended before its first token; the client already has the prefill "
                   f"engine's (token id {sent.token_id}, text {sent.text!r})", sent)


def _drop_first(choice: dict[str, Any], first: FirstToken, chat: bool) -> None:
    """Remove ``first`` from the front of one decode-engine choice (its token ids, text and logprobs).

    Raises:
        FirstTokenMismatch: the choice starts with another token id or text.
    """
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise FirstTokenMismatch.differs(first, ids, "token ids")
    if ids[0] != first.token_id:
        raise FirstTokenMismatch.differs(first, ids[0], "token id")
    choice["token_ids"] = ids[1:]
    holder = choice.get("delta") if chat else choice
    key = "content" if chat else "text"
    text = holder.get(key) if isinstance(holder, dict) else None
    if not isinstance(text, str) or not text.startswith(first.text):
        raise FirstTokenMismatch.differs(first, text, "text")
    holder[key] = text[len(first.text):]
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for name in ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            if isinstance(logprobs.get(name), list):
                logprobs[name] = logprobs[name][1:]


def _empty(choice: dict[str, Any], chat: bool) -> bool:
    """True when a choice says nothing once the first token is gone (no token, no text, not the end)."""
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return not choice.get("token_ids") and not text and choice.get("finish_reason") is None


class StreamedFirstTokenStream(FirstTokenStream):
    """The client's stream when a layer-streamed request's first token is handed over: ``first``'s chunks, then
    the decode engine's stream (which starts at the client's prompt) with its own first token checked and
    removed, ids and usage as one engine's.

    Args:
        path: ``/v1/completions`` or ``/v1/chat/completions``.
        body: the client's request (the legs were asked for token ids; they are removed unless it asked too).
        first: the prefill engine's first token.
    """

    def __init__(self, path: str, body: dict[str, Any], first: FirstToken) -> None:
        super().__init__(path, body, first, continued=False)
        self.confirmed = False
        """The decode engine's first token was found equal to ``first`` (and removed)."""

    def rewrite_chunk(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """See :meth:`FirstTokenStream.rewrite_chunk`.

        Raises:
            FirstTokenMismatch: the decode engine's first token is not ``first``.
        """
        out = super().rewrite_chunk(obj)
        if out is None or "error" in out:
            return out
        choices = [c for c in out.get("choices") or [] if isinstance(c, dict)]
        if not self.confirmed and choices:
            _drop_first(choices[0], self.first, self.chat)
            self.confirmed = True
            if all(_empty(c, self.chat) for c in choices):
                return None
        if not self.token_ids:
            for choice in choices:
                choice.pop("token_ids", None)
        return out


def without_token_ids(data: str) -> bytes:
    """One ``data:`` payload of the decode engine's stream as the client gets it when it did not ask for token
    ids (only the legs did): ``token_ids`` and ``prompt_token_ids`` removed."""
    try:
        obj = json.loads(data)
    except ValueError:
        return sse_event(data)
    if isinstance(obj, dict):
        obj.pop("prompt_token_ids", None)
        for choice in obj.get("choices") or []:
            if isinstance(choice, dict):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
    return sse_event(obj)


async def _first_done(prefill_leg: asyncio.Future, first_event: asyncio.Future) -> None:
    """Wait for the prefill leg's answer or the decode engine's first event, whichever comes first."""
    await asyncio.wait({prefill_leg, first_event}, return_when=asyncio.FIRST_COMPLETED)


def engine_url(resp: httpx.Response, path: str) -> str | None:
    """The base URL of the engine that opened ``resp`` (asked at ``<base><path>``); None when it is not known."""
    try:
        sent = str(resp.url)
    except (AttributeError, RuntimeError):  # a response built without its request
        return None
    return sent[: -len(path)] if sent.endswith(path) else None


def _first_token(first_event: asyncio.Future, answer: dict[str, Any] | None, path: str,
                 body: dict[str, Any]) -> FirstToken | Fallback:
    """The prefill engine's first token to hand over, or why the decode engine's goes: its first event came first,
    the prefill leg failed, or the prefill answer has no usable token."""
    if first_event.done():
        return Fallback.DECODE_FIRST
    if answer is None:
        return Fallback.PREFILL_ANSWER
    return first_token_or_fallback(path, body, answer)


def _prefill_answer(prefill_leg: asyncio.Future) -> dict[str, Any] | None:
    """The prefill leg's answer when it has come (None: not yet, or it failed: that failure is logged where the
    leg ends)."""
    if not prefill_leg.done() or prefill_leg.cancelled() or prefill_leg.exception() is not None:
        return None
    answer = prefill_leg.result()
    return answer if isinstance(answer, dict) else None


def stream_hand_over(legs: DecodeLegs, client: httpx.AsyncClient, resp: httpx.Response, prefill_leg: asyncio.Future,
                     path: str, body: dict[str, Any], headers: dict[str, str], out_headers: dict[str, str],
                     leg: ProxySpan | None = None, trace: RequestTrace | None = None,
                     on_end: Callable[[], None] | None = None, recovery: Recovery | None = None,
                     prefill_first: bool = True) -> StreamingResponse:
    """The client's stream of a greedy or seeded layer-streamed request: the prefill engine's first token when it
    comes first, then the decode engine's stream ``resp`` (opened, asked with token ids) after that token.

    ``prefill_leg`` is the prompt's prefill leg (its answer: the prefill
    engine's JSON). ``body`` is the client's request (``headers`` go with a
    continuation over ``client``). ``leg``: the decode leg's span, ended
    here. The decode stream is closed (the decode engine aborts the request)
    when the first token ends the answer, when the client leaves (before the
    first byte too), and on a mismatch, which a continuation follows
    (:func:`p2pkv.tools.proxy.hand_over.continue_after`); ``on_end`` is called
    once it is closed (the decode leg has ended).

    With ``recovery``, what the prefill leg ended with before anything of the
    decode engine's stream reached the client is acted on
    (:mod:`p2pkv.tools.proxy.stream_faults`): its failure closes the decode
    stream and ends the client's with the prefill leg's error at once; an
    answer for another engine id (a restart) or without a hold sends the decode
    leg again with its params (also when the decode engine's first event was
    its failure). ``prefill_first`` False: the decode engine's first token goes (the
    request is not greedy or seeded, or the proxy keeps the decode engine's
    first tokens), its stream relayed as it is.
    """
    client_ids = body.get("return_token_ids") is True
    closed = False

    async def close() -> None:
        nonlocal closed
        if closed:
            return
        closed = True
        await resp.aclose()
        if on_end is not None:
            on_end()

    async def stream() -> AsyncIterator[bytes]:
        sent = time.perf_counter()
        events = sse_events(resp.aiter_raw()).__aiter__()
        first_event = asyncio.ensure_future(events.__anext__())
        writer: StreamedFirstTokenStream | None = None
        try:
            await _first_done(prefill_leg, first_event)
            if recovery is not None and (elsewhere := await _recovered(recovery, prefill_leg, first_event, close)):
                async for out in elsewhere:
                    yield out
                return
            answer = None if first_event.done() or not prefill_first else _prefill_answer(prefill_leg)
            first = _first_token(first_event, answer, path, body) if prefill_first else Fallback.DECODE_FIRST
            if prefill_first:
                legs.metrics.count_first_token(first)
            if isinstance(first, FirstToken) and answer is not None:
                writer = StreamedFirstTokenStream(path, body, first)
                hand_over = None if trace is None else trace.first_token(answer.get("kv_transfer_params") or {},
                                                                         first.finish_reason)
                yield writer.opening()
                if hand_over is not None:
                    hand_over.end()
                if first.finish_reason is not None:
                    return
            async for out in _relayed(legs, writer, first_event, events, sent, leg, client_ids):
                yield out
        except FirstTokenMismatch as exc:
            logger.warning("p2pkv proxy: %s; the decode engine continues after the client's token", exc)
            legs.metrics.first_token_mismatches.inc()
            if leg is not None:
                leg.end()
            await close()  # the decode engine aborts the stream's request
            async for out in continue_after(legs, client, path, body, exc.first, headers, out_headers, trace,
                                            url=engine_url(resp, path)):
                yield out
        except httpx.HTTPError as exc:
            yield sse_event(broken_decode_stream(legs, exc, resp, leg).payload()) + sse_event("[DONE]")
        finally:
            first_event.cancel()
            with contextlib.suppress(BaseException):
                await first_event
            await close()
            legs.metrics.decode_seconds.observe(time.perf_counter() - sent, exemplar(leg))
            if leg is not None:
                leg.end()

    return ClosingStream(stream(), close, headers=out_headers)


async def _recovered(recovery: Recovery, prefill_leg: asyncio.Future, first_event: asyncio.Future,
                     close: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes] | None:
    """The client's stream when the prefill leg's end takes the place of the decode engine's stream (None: it does
    not; the decode engine's stream goes on): its failure, or an answer that no stream will follow, first; or the
    decode engine's first event an error that such an answer explains. The decode stream is closed then."""
    if first_event.done():
        with contextlib.suppress(BaseException):
            if not is_error_event(first_event.result()):
                return None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(prefill_leg), recovery.wait_s)
        if prefill_end(recovery.granted, prefill_leg) is not PrefillEnd.ELSEWHERE:
            return None
    end = prefill_end(recovery.granted, prefill_leg)
    if end is PrefillEnd.FAILED:
        await close()
        return _once(sse_event(prefill_error(prefill_leg).payload()) + sse_event("[DONE]"))
    if end is not PrefillEnd.ELSEWHERE:
        return None
    recovery.claim()  # before the close: the first decode leg's end must not free this hold
    await close()
    logger.warning("p2pkv proxy: the prefill engine answered for engine %s, not the grant's %s, or without a hold; "
                   "the decode leg goes again with its params", answer_params(prefill_leg).get("remote_engine_id"),
                   recovery.granted.get("remote_engine_id"))
    return recovery.again(answer_params(prefill_leg))


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _relayed(legs: DecodeLegs, writer: StreamedFirstTokenStream | None, first_event: asyncio.Future,
                   events: AsyncIterator[str], sent: float, leg: ProxySpan | None,
                   client_ids: bool) -> AsyncIterator[bytes]:
    """The decode engine's events as the client gets them: after the handed-over token (``writer``), or as they
    are (``writer`` None; token ids kept only when the client asked for them).

    Raises:
        httpx.HTTPError: the decode stream broke.
        FirstTokenMismatch: the decode engine's first token is not the one handed over (nothing of its stream
            was sent), or its stream ended without one and without an error.
    """
    try:
        data: str | None = await first_event
    except StopAsyncIteration:
        data = None
    legs.metrics.decode_first_byte_seconds.observe(time.perf_counter() - sent, exemplar(leg))
    errored = False
    while data is not None:
        if writer is None:
            yield sse_event(data) if client_ids else without_token_ids(data)
        elif data != "[DONE]":
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                yield sse_event(data)
            else:
                errored = errored or "error" in obj
                out = writer.rewrite_chunk(obj)
                if out is not None:
                    yield sse_event(out)
        try:
            data = await events.__anext__()
        except StopAsyncIteration:
            data = None
    if writer is None:
        return
    if not writer.confirmed and not errored:
        raise FirstTokenMismatch.missing(writer.first)
    yield writer.closing(writer.usage_chunk)

