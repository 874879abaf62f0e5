"""A completions request with several prompts: one prefill/decode pair per prompt, at most ``max_fanout`` at once.

A pair holds its slot from its prefill request to the end of its decode
answer, so a long prompt list never has more than ``max_fanout`` prompts
prefilled and held on the prefill engines, or decoding, at once (without the
bound one request of 256 prompts would send 256 prefills together and keep
every prompt's KV blocks held until its decode leg comes).

With ``--transfer-mode stream`` each pair's two legs go at once
(:meth:`p2pkv.tools.proxy.app.Proxy.start_stream`) and the pair's slot is
held until its decode answer ends.

Failures: a non-streamed batch answers the first failed prompt's error
(prompt order); pairs not started by then are skipped, and a prefill hold
whose decode leg will not come is freed. A streamed batch answers with the
error when a pair fails before any decode stream opened; once the stream has
started, a failed pair becomes an error event in it and the other prompts go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
from fastapi.responses import JSONResponse, Response

from p2pkv.tools.proxy.batch import StreamMerger, merge_completions, sse_events
from p2pkv.tools.proxy.closing import ClosingStream
from p2pkv.tools.proxy.proxy_metrics import ProxyMetrics
from p2pkv.tools.proxy.proxy_spans import ProxySpan, RequestTrace, leg_of
from p2pkv.tools.proxy.stream import StreamLegs
from p2pkv.tools.proxy.stream_faults import (
    PrefillEnd,
    Recovery,
    answer_params,
    cancel,
    is_error_event,
    prefill_end,
    prefill_error,
    relay_again,
    whole_decode,
)
from p2pkv.tools.proxy.upstream import UpstreamError

logger = logging.getLogger("p2pkv.proxy")


class Legs(Protocol):
    """What a batch needs of :class:`p2pkv.tools.proxy.app.Proxy`: the two legs, releases, metrics."""

    metrics: ProxyMetrics
    streams: StreamLegs | None
    secret: bytes | None
    timeout_s: float

    async def run_prefill(self, client: httpx.AsyncClient, path: str, body: dict[str, Any],
                          headers: dict[str, str], leg: ProxySpan | None = None) -> dict[str, Any]: ...

    async def run_decode(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                         out_headers: dict[str, str], relay: bool = True,
                         leg: ProxySpan | None = None) -> Response | httpx.Response: ...

    async def release(self, params_list: list[dict[str, Any]]) -> None: ...

    def decode_ended(self, body: dict[str, Any]) -> None: ...

    def start_stream(self, client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str],
                     trace: RequestTrace | None = None, index: int = 0) -> dict[str, Any] | None: ...


class Skipped(Exception):
    """A pair that did not run (or whose decode leg was not sent) because the batch had already failed."""


_OPENED, _DONE = object(), object()
"""Queue markers of a streamed batch: a pair's decode stream opened; a pair ended."""


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Batch:
    """The pairs of one batched completions request.

    Args:
        proxy: the proxy (engines, releases, metrics).
        client: the shared HTTP client.
        path: ``/v1/completions``.
        headers: headers for the engines (the proxy's request id).
        out_headers: headers of the client's answer.
        max_fanout: most pairs running at once (>= 1).
        trace: the request's spans (tracing on): each prompt's legs get theirs under it.
    """

    def __init__(self, proxy: Legs, client: httpx.AsyncClient, path: str, headers: dict[str, str],
                 out_headers: dict[str, str], max_fanout: int, trace: RequestTrace | None = None) -> None:
        self.proxy, self.client, self.path, self.trace = proxy, client, path, trace
        self.headers, self.out_headers = headers, out_headers
        self.slots = asyncio.Semaphore(max_fanout)
        self.stop = asyncio.Event()
        """Set when the batch's answer is an error: pairs not yet decoding are skipped."""
        self.opened = False
        """A streamed batch: a decode stream has opened, so the answer is a stream (later failures are events)."""

    async def _prefill(self, index: int, body: dict[str, Any]) -> dict[str, Any]:
        """Prompt ``index``'s prefill (the caller holds a slot); its ``kv_transfer_params``. A proxy that streams
        sends the prefill leg in the background and returns the decode leg's params at once.

        Raises:
            Skipped: the batch failed before or during it (a hold it made is freed).
            UpstreamError: the prefill failed.
        """
        if self.stop.is_set():
            raise Skipped
        streamed = self.proxy.start_stream(self.client, self.path, body, self.headers, self.trace, index)
        if streamed is not None:
            return streamed
        answer = await self.proxy.run_prefill(self.client, self.path, body, self.headers,
                                              leg_of(self.trace, "prefill", index))
        params = answer["kv_transfer_params"]
        if self.stop.is_set():
            await self.proxy.release([params])
            raise Skipped
        return params

    async def _decode(self, body: dict[str, Any], params: dict[str, Any],
                      span: ProxySpan | None) -> Response | httpx.Response:
        """One prompt's decode leg (an opened stream when ``stream`` is true); a hold it never pulls is freed.

        ``span``: the leg's span (tracing on); the caller ends it after an opened stream.

        Raises:
            UpstreamError: the decode engine failed or refused.
        """
        leg = {**body, "kv_transfer_params": params}
        try:
            return await self.proxy.run_decode(self.client, self.path, leg, self.headers, self.out_headers,
                                               relay=False, leg=span)
        except UpstreamError:
            await self.proxy.release([params])
            raise
        except asyncio.CancelledError:  # the client went away: nobody may pull it
            await asyncio.shield(self.proxy.release([params]))
            raise

    async def _answer(self, index: int, body: dict[str, Any]) -> dict[str, Any]:
        """Prompt ``index``'s answer, not streamed (JSON).

        Raises:
            Skipped: the batch failed first.
            UpstreamError: a leg failed (the batch is stopped).
        """
        try:
            async with self.slots:
                params = await self._prefill(index, body)
                decode = self._decode(body, params, leg_of(self.trace, "decode", index))
                streams = self.proxy.streams
                prefill_leg = streams.prefill_leg(params) if streams is not None else None
                if streams is None or prefill_leg is None:
                    resp = await decode
                else:  # a streamed prompt: its prefill leg's failure, or an answer for another engine, acted on
                    recovery = Recovery(params, lambda p: relay_again(self.proxy, self.client, self.path, body, p,
                                                                      self.headers, self.out_headers),
                                        lambda: streams.claim(params), self.proxy.release, self.proxy.timeout_s)
                    resp = await whole_decode(decode, prefill_leg, recovery, lambda p: self._decode(body, p, None))
        except UpstreamError:
            self.stop.set()
            raise
        assert isinstance(resp, Response)
        try:
            return json.loads(resp.body)
        except ValueError as exc:
            self.stop.set()
            raise UpstreamError(502, f"decode engine answered non-JSON: {bytes(resp.body[:300])!r}; check its log",
                                "decode", "") from exc

    async def answers(self, bodies: list[dict[str, Any]]) -> Response:
        """Every prompt answered, merged into one completions answer.

        Raises:
            UpstreamError: the first failed prompt's error (prompt order).
        """
        results = await asyncio.gather(*(self._answer(i, b) for i, b in enumerate(bodies)), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Skipped):
                raise r
        return JSONResponse(merge_completions(results), headers=self.out_headers)  # type: ignore[arg-type]

    async def _stream_pair(self, index: int, body: dict[str, Any], queue: asyncio.Queue[Any],
                           merger: StreamMerger) -> None:
        """One prompt's pair: ``_OPENED``, its stream's chunks, then ``_DONE`` put on ``queue``; a failure is put
        there as the :class:`UpstreamError` (and stops the batch when no stream has opened yet)."""
        span: ProxySpan | None = None
        try:
            async with self.slots:
                try:
                    params = await self._prefill(index, body)
                    span = leg_of(self.trace, "decode", index)
                    resp = await self._decode(body, params, span)
                except UpstreamError as exc:
                    if not self.opened:  # the answer will be this error: pairs not started must not start
                        self.stop.set()
                    await queue.put(exc)
                    return
                assert isinstance(resp, httpx.Response)
                try:
                    if self.stop.is_set():
                        return
                    failed, events, resp = await self._opening(body, params, resp)
                    if failed is not None:
                        if not self.opened:
                            self.stop.set()
                        await queue.put(failed)
                        return
                    self.opened = True
                    await queue.put(_OPENED)
                    async for data in events:
                        if self.stop.is_set():  # the batch answered with another pair's error
                            return
                        if (out := merger.chunk(index, data)) is not None:
                            await queue.put(out)
                except httpx.HTTPError as exc:
                    err = UpstreamError(502, f"decode engine failed mid-stream ({type(exc).__name__}: {exc}); "
                                        "check its log", "decode", str(resp.url))
                    if span is not None:
                        span.failed(err)
                    await queue.put(err)
                finally:
                    await resp.aclose()
                    self.proxy.decode_ended({**body, "kv_transfer_params": params})
        except Skipped:
            pass
        finally:
            if span is not None:
                span.end()
            queue.put_nowait(_DONE)

    async def _opening(self, body: dict[str, Any], params: dict[str, Any], resp: httpx.Response
                       ) -> tuple[UpstreamError | None, AsyncIterator[str], httpx.Response]:
        """``(error, events, resp)`` for prompt ``body``'s decode stream ``resp`` (its leg carries ``params``),
        with what a streamed prompt's prefill leg says acted on (:mod:`p2pkv.tools.proxy.stream_faults`) before
        its first event reaches the client:

        * the prefill leg failed first: its error (the caller closes the decode stream: its engine gives the
          stream up);
        * it answered for another engine id or without a hold (the prefill engine restarted: no stream will
          come), before the decode stream's first event or with that event an error it explains: the first
          decode stream closed, the prompt's decode leg sent again with the answer's params (a push, or
          computed on the decode engine), and that stream's events and response;
        * else None, and the decode stream's events (its first, if it came, included) and ``resp``.

        The decode leg sent again failing or refused is an error too.
        """
        events = sse_events(resp.aiter_raw())
        streams = self.proxy.streams
        prefill_leg = streams.prefill_leg(params) if streams is not None else None
        if streams is None or prefill_leg is None:
            return None, events, resp
        rest = events.__aiter__()
        first = asyncio.ensure_future(rest.__anext__())
        await asyncio.wait({first, prefill_leg}, return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            if first.cancelled() or first.exception() is not None or not is_error_event(first.result()):
                return None, _after(first, rest), resp
            with contextlib.suppress(Exception):  # an error the prefill leg's answer may explain
                await asyncio.wait_for(asyncio.shield(prefill_leg), self.proxy.timeout_s)
            if prefill_end(params, prefill_leg) is not PrefillEnd.ELSEWHERE:
                return None, _after(first, rest), resp
        end = prefill_end(params, prefill_leg)
        if end is PrefillEnd.FAILED:
            await cancel(first)
            return prefill_error(prefill_leg), rest, resp
        if end is not PrefillEnd.ELSEWHERE:
            return None, _after(first, rest), resp
        streams.claim(params)  # before the close: the first decode leg's end must not free this hold
        await cancel(first)
        await resp.aclose()
        again = answer_params(prefill_leg)
        logger.warning("p2pkv proxy: the prefill engine answered for engine %s, not the grant's %s, or without a "
                       "hold; a prompt of the batch goes to its decode engine again with those params",
                       again.get("remote_engine_id"), params.get("remote_engine_id"))
        try:
            opened = await self._decode(body, again, None)
        except UpstreamError as exc:  # its hold freed by _decode
            return exc, rest, resp
        if not isinstance(opened, httpx.Response):  # a 4xx answer, passed through by run_decode
            await self.proxy.release([again])
            return UpstreamError(502, f"the decode engine refused the prompt sent again (HTTP {opened.status_code})",
                                 "decode", ""), rest, resp
        return None, sse_events(opened.aiter_raw()), opened

    async def stream(self, bodies: list[dict[str, Any]]) -> Response:
        """Every prompt's decode stream merged into one (see :class:`StreamMerger`), pairs bounded.

        Returns once a decode stream opened. However the answer ends (its last byte sent, or the client gone, before
        its first byte too), the pairs still running are stopped: their decode streams closed (the engines abort
        the requests), their legs reported ended. Raises UpstreamError: a pair failed first (the others are stopped
        and waited for, their holds freed).
        """
        merger, queue_ = StreamMerger(), asyncio.Queue()
        tasks = [asyncio.create_task(self._stream_pair(i, b, queue_, merger)) for i, b in enumerate(bodies)]
        done = 0
        try:
            while True:
                item = await queue_.get()
                if item is _OPENED:
                    break
                if item is _DONE:
                    done += 1
                    if done == len(tasks):
                        raise UpstreamError(502, "no prompt of the batch was decoded", "decode", "")
                elif isinstance(item, UpstreamError):
                    self.stop.set()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise item
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        metrics = self.proxy.metrics

        async def body() -> AsyncIterator[bytes]:
            ended = done
            while ended < len(tasks):
                item = await queue_.get()
                if item is _DONE:
                    ended += 1
                elif isinstance(item, UpstreamError):
                    if item.backend_failed:
                        metrics.errors.labels(item.stage).inc()
                    yield _event(item.payload())
                elif isinstance(item, bytes):
                    yield item
            yield merger.end()

        async def stop_pairs() -> None:  # however the answer ended: the client gone before its first byte too
            for t in tasks:
                t.cancel()

        return ClosingStream(body(), stop_pairs, headers=self.out_headers)


async def _after(first: asyncio.Future, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """``first``'s event (when the stream had one), then ``rest``'s."""
    try:
        data = await first
    except StopAsyncIteration:
        return
    yield data
    async for data in rest:
        yield data
