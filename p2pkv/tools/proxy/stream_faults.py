"""A layer-streamed prompt whose prefill leg fails, or whose prefill engine answers for another engine id.

In stream mode the proxy sends both legs at once, and the decode leg waits
for KV that only the prefill leg computes. In pull and push mode a failed
prefill leg ends the request at once (the decode leg is never sent); here
the decode leg is already under way, so what the prefill leg's end says is
acted on at once too (:func:`prefill_end`):

* **It failed** (connection refused or reset, an HTTP error, its timeout):
  the decode leg is cancelled (its engine aborts the request, gives the stream
  up and frees its blocks) and the client gets the prefill leg's error, HTTP
  502 naming the prefill engine, as in pull and push mode, within the time
  the failure took to show, never the stream's window. That is the default,
  and the only behaviour: it is what the other ways do, a router in front
  retries elsewhere, and a proxy that quietly moved every prompt of a dead
  prefill pod onto the decode engines would slow every answer they stream.
* **It answered for another engine id than the grant named** (the prefill
  engine restarted since the proxy learned its address: the new process
  refused the old grant and held the prompt for a pull or push, and the
  proxy re-learns its address from this answer), **with a hold it did not
  stream** (its answer lacks :data:`p2pkv.grant.STREAMED_KEY`: it refused the
  grant, say expired), **or without a hold** (a replayed grant, the
  engine's cap): no stream will come. The decode leg is
  cancelled, or its failure (the new process refuses its destination) is not
  passed on, and the prompt's decode leg goes again with the answer's params,
  as in push mode, or, without a hold, computes the prompt on the decode
  engine: the client gets the right answer, not an error. The hold of the
  answer is taken over by that leg (freed if it fails), not freed when the
  first decode leg ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import Response

from p2pkv.grant import STREAMED_KEY
from p2pkv.scheduling.hold_scheduling import NO_HOLD_KEY
from p2pkv.tools.proxy.batch import sse_events
from p2pkv.tools.proxy.first_token import sse_event
from p2pkv.tools.proxy.hand_over import DecodeLegs
from p2pkv.tools.proxy.upstream import UpstreamError

logger = logging.getLogger("p2pkv.proxy")


class PrefillEnd(enum.Enum):
    """What a streamed prompt's prefill leg ended with, for its decode leg."""

    STREAMED = "streamed"
    """It answered for the grant's engine with a hold: the stream runs (or ran) as granted."""
    FAILED = "failed"
    """It failed: no KV will come; the client gets its error."""
    ELSEWHERE = "elsewhere"
    """It answered for another engine id (a restart) or without a hold: no stream will come; the decode leg goes
    again with the answer's params."""


def prefill_end(granted: dict[str, Any], prefill_leg: asyncio.Future) -> PrefillEnd | None:
    """What ``prefill_leg`` (the prompt's prefill leg: its answer, the prefill engine's JSON) ended with for the
    decode leg whose params are ``granted``; None while it runs. Pure: no I/O."""
    if not prefill_leg.done():
        return None
    if prefill_leg.cancelled() or prefill_leg.exception() is not None:
        return PrefillEnd.FAILED
    answer = prefill_leg.result()
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        return PrefillEnd.FAILED
    if params.get("do_remote_prefill") is not True or NO_HOLD_KEY in params:
        return PrefillEnd.ELSEWHERE
    if params.get("remote_engine_id") != granted.get("remote_engine_id") or params.get(STREAMED_KEY) is not True:
        return PrefillEnd.ELSEWHERE  # a restart, or a grant refused there: held for a pull or push
    return PrefillEnd.STREAMED


def prefill_error(prefill_leg: asyncio.Future) -> UpstreamError:
    """The error a failed prefill leg gives the client (its own, or one saying it was cancelled)."""
    exc = None if prefill_leg.cancelled() else prefill_leg.exception()
    if isinstance(exc, UpstreamError):
        return exc
    return UpstreamError(502, f"the prompt's prefill leg failed ({exc!r}); its decode leg was cancelled",
                         "prefill", "")


def answer_params(prefill_leg: asyncio.Future) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill leg that ended :attr:`PrefillEnd.ELSEWHERE` answered with."""
    return prefill_leg.result()["kv_transfer_params"]


async def cancel(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait for it to end (whatever it raises)."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


@dataclass(frozen=True)
class Recovery:
    """What a streamed prompt's decode leg needs to act on its prefill leg's end (:func:`whole_decode`,
    :func:`p2pkv.tools.proxy.stream_hand_over.stream_hand_over`).

    Attributes:
        granted: the decode leg's ``kv_transfer_params`` (the grant and the prefill engine's address).
        again: the client's stream from a decode leg sent again with the given params.
        claim: takes the prefill leg's hold over from the first decode leg (its end then frees nothing).
        release: frees the hold the given params name.
        wait_s: longest wait for the prefill leg once the decode leg has failed (seconds).
    """

    granted: dict[str, Any]
    again: Callable[[dict[str, Any]], AsyncIterator[bytes]]
    claim: Callable[[], None]
    release: Callable[[list[dict[str, Any]]], Awaitable[Any]]
    wait_s: float


async def whole_decode(decode: Awaitable[Any], prefill_leg: asyncio.Future, recovery: Recovery,
                       again: Callable[[dict[str, Any]], Awaitable[Any]]) -> Any:
    """A non-streaming client's decode leg ``decode`` (its answer read whole), with what its prefill leg says acted
    on (see the module docstring).

    Args:
        decode: the decode leg (returns the client's response; raises UpstreamError).
        prefill_leg: the prompt's prefill leg.
        recovery: the decode leg's grant, and how to take its hold over or free it.
        again: sends the decode leg again with the given params (push, or computed on the decode engine).

    Raises:
        UpstreamError: the prefill leg failed first (its error), or the decode leg failed and the prefill leg
            does not explain it.
    """
    granted = recovery.granted
    task = asyncio.ensure_future(decode)
    await asyncio.wait({task, prefill_leg}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        end = prefill_end(granted, prefill_leg)
        if end is PrefillEnd.FAILED:
            await cancel(task)
            raise prefill_error(prefill_leg)
        if end is PrefillEnd.ELSEWHERE:
            recovery.claim()
            await cancel(task)
            logger.warning("p2pkv proxy: the prefill engine answered for engine %s, not the grant's %s, or "
                           "without a hold; the decode leg goes again with its params",
                           answer_params(prefill_leg).get("remote_engine_id"), granted.get("remote_engine_id"))
            return await again(answer_params(prefill_leg))
        return await task
    try:
        return task.result()
    except UpstreamError as exc:
        if exc.stage != "decode" or not exc.backend_failed or exc.status < 500:
            raise
        recovery.claim()  # now, before the first leg's end frees the hold: it is this function's to free or load
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(prefill_leg), recovery.wait_s)
        end = prefill_end(granted, prefill_leg)
        if end is not PrefillEnd.ELSEWHERE:
            if end is PrefillEnd.STREAMED:
                await recovery.release([answer_params(prefill_leg)])
            raise
        logger.warning("p2pkv proxy: the decode leg failed and the prefill engine answered for engine %s, not "
                       "the grant's %s (it restarted), or without a hold; the decode leg goes again with its "
                       "params", answer_params(prefill_leg).get("remote_engine_id"), granted.get("remote_engine_id"))
        return await again(answer_params(prefill_leg))


def is_error_event(data: str | None) -> bool:
    """Whether one ``data:`` payload of a decode engine's stream is an error (its request failed)."""
    if not data or data == "[DONE]":
        return False
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    return isinstance(obj, dict) and "error" in obj


async def relay_again(legs: DecodeLegs, client: httpx.AsyncClient, path: str, body: dict[str, Any],
                      params: dict[str, Any], headers: dict[str, str],
                      out_headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The client's stream from the decode leg of ``body`` sent again with ``params`` (a push of the prefill
    engine's hold, or none: computed there), relayed as it is; its hold freed when it fails (an error event
    ends the stream)."""
    try:
        resp = await legs.run_decode(client, path, {**body, "kv_transfer_params": params}, headers, out_headers,
                                     relay=False)
    except UpstreamError as exc:
        await legs.release([params])
        yield sse_event(exc.payload()) + sse_event("[DONE]")
        return
    if isinstance(resp, Response):  # a 4xx answer, passed through by run_decode
        await legs.release([params])
        err = UpstreamError(502, f"the decode engine refused the prompt sent again (HTTP {resp.status_code})",
                            "decode", "")
        yield sse_event(err.payload()) + sse_event("[DONE]")
        return
    try:
        async for data in sse_events(resp.aiter_raw()):
            yield sse_event(data)
    except httpx.HTTPError as exc:
        err = UpstreamError(502, f"decode engine failed mid-stream ({type(exc).__name__}: {exc})", "decode",
                            str(resp.url))
        yield sse_event(err.payload()) + sse_event("[DONE]")
    finally:
        await resp.aclose()


__all__ = ["PrefillEnd", "Recovery", "answer_params", "cancel", "is_error_event", "prefill_end", "prefill_error",
           "relay_again", "whole_decode"]
