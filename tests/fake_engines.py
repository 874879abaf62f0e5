"""Fake OpenAI-compatible engines on 127.0.0.1 for proxy tests (real HTTP, scripted answers)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

T = TypeVar("T")

KV_PARAMS: dict[str, Any] = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]],
                             "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "<id>",
                             "tp_size": 1}
CHUNKS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
          b'data: {"choices": [{"text": "c"}]}\n\n', b"data: [DONE]\n\n"]
ERROR_BODY = {"object": "error", "message": "prompt too long", "type": "BadRequestError", "code": 400}


class Concurrency:
    """Requests in flight, counted across engines (each serves on its own thread), and the most at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def exit(self) -> None:
        with self.lock:
            self.now -= 1


async def _counted(chunks: AsyncIterator[Any], tracker: Concurrency) -> AsyncIterator[Any]:
    """``chunks``, the stream counted out of ``tracker`` just before its last chunk goes (so the proxy's next
    request can never overlap it in the count)."""
    counted = True
    try:
        async for chunk in chunks:
            if chunk == CHUNKS[-1]:
                tracker.exit()
                counted = False
            yield chunk
    finally:
        if counted:
            tracker.exit()


class FakeEngine:
    """A fake prefill or decode engine recording each request; ``mode`` picks how it answers completions.

    Modes: ``ok``; ``no_params`` (prefill answer without kv_transfer_params);
    ``400`` / ``500``; ``sleep`` (answers after 1.5 s); ``slow_stream`` (a
    chunk every 20 ms for 10 s, appending the count sent to ``closed_after``
    if the stream is cut short); ``broken_stream`` (dies after one chunk);
    ``p2pkv`` (a prefill answer as p2pkv's engines give it with
    ``return_token_ids``: token 7 after prompt ``PROMPT_IDS``); ``held`` (the
    decode stream starts once ``gate`` is set).

    ``delay_s`` delays every completions answer; ``fail_prompt`` answers 400
    to a request with that prompt; ``tracker`` counts requests in flight (a
    streamed answer until its last chunk); ``params`` is the prefill answer's
    ``kv_transfer_params``. Each request is recorded in ``seen`` with its
    body, ``X-Request-Id``, ``Authorization`` and ``traceparent`` headers.
    """

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role, self.mode, self.healthy = name, role, "ok", True
        self.seen: list[dict[str, Any]] = []
        self.closed_after: list[int] = []
        self.gate = threading.Event()
        self.delay_s, self.fail_prompt, self.tracker = 0.0, None, None
        self.params: dict[str, Any] = KV_PARAMS
        self.app = FastAPI()
        self.app.post("/v1/completions")(self.completion)
        self.app.post("/v1/chat/completions")(self.completion)
        self.app.get("/health")(self.health)
        self.app.get("/v1/models")(self.models)

    def reset(self) -> None:
        self.seen.clear()
        self.closed_after.clear()
        self.mode, self.healthy = "ok", True
        self.delay_s, self.fail_prompt, self.tracker = 0.0, None, None
        self.params = KV_PARAMS
        self.gate.clear()

    async def completion(self, request: Request) -> Any:
        body = await request.json()
        self.seen.append({"path": request.url.path, "body": body, "rid": request.headers.get("x-request-id"),
                          "auth": request.headers.get("authorization"),
                          "traceparent": request.headers.get("traceparent")})
        tracker: Concurrency | None = self.tracker
        if tracker is not None:
            tracker.enter()
        resp = None
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            resp = await self.answer(request, body)
            return resp
        finally:
            if tracker is not None and isinstance(resp, StreamingResponse):
                resp.body_iterator = _counted(resp.body_iterator, tracker)  # in flight until its last chunk
            elif tracker is not None:
                tracker.exit()

    async def answer(self, request: Request, body: dict[str, Any]) -> Any:
        if self.fail_prompt is not None and body.get("prompt") == self.fail_prompt:
            return JSONResponse(ERROR_BODY, status_code=400)
        if self.mode in ("400", "500"):
            return JSONResponse(ERROR_BODY, status_code=int(self.mode))
        if self.mode == "sleep":
            await asyncio.sleep(1.5)
        if self.role == "prefill" and self.mode == "p2pkv":
            return p2pkv_prefill_answer(request.url.path)
        if self.mode == "held":
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
        if self.role == "prefill":
            extra = {} if self.mode == "no_params" else {"kv_transfer_params": self.params}
            return {"id": "p", "choices": [{"text": "x"}], **extra}
        if body.get("stream"):
            gen = self.slow() if self.mode == "slow_stream" else self.chunks()
            return StreamingResponse(gen, media_type="text/event-stream")
        return {"id": "d", "choices": [{"text": "decoded"}]}

    async def chunks(self) -> Any:
        for chunk in CHUNKS:
            yield chunk
            await asyncio.sleep(0.01)
            if self.mode == "broken_stream":
                raise RuntimeError("engine died mid-stream (expected by the test)")

    async def slow(self) -> Any:
        sent = 0
        try:
            for sent in range(1, 501):  # noqa: B007
                yield b'data: {"choices": [{"text": "t"}]}\n\n'
                await asyncio.sleep(0.02)
        finally:
            if sent < 500:
                self.closed_after.append(sent)

    async def health(self) -> Any:
        return JSONResponse({}, status_code=200 if self.healthy else 503)

    async def models(self, request: Request) -> Any:
        return {"object": "list", "data": [{"id": "tiny", "owned_by": self.name}],
                "auth": request.headers.get("authorization")}


PROMPT_IDS = [3, 4, 5]
"""The prompt's token ids in ``p2pkv`` mode answers."""


def p2pkv_prefill_answer(path: str) -> dict[str, Any]:
    """A p2pkv prefill engine's one-token answer (``return_token_ids``): token 7, text ``"x"``, 3 prompt tokens."""
    params = {**KV_PARAMS, "kv_connector": "P2pKvConnector", "first_token": True, "remote_num_tokens": 3}
    common = {"finish_reason": "length", "stop_reason": None, "token_ids": [7], "index": 0}
    if path.endswith("/chat/completions"):
        return {"id": "chatcmpl-p", "object": "chat.completion", "created": 11, "model": "tiny",
                "prompt_token_ids": PROMPT_IDS, "kv_transfer_params": params,
                "choices": [{"message": {"role": "assistant", "content": "x"}, **common}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    return {"id": "cmpl-p", "object": "text_completion", "created": 11, "model": "tiny", "kv_transfer_params": params,
            "choices": [{"text": "x", "prompt_token_ids": PROMPT_IDS, **common}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


class Served:
    """An ASGI app served by uvicorn (lifespan on) in a daemon thread on an ephemeral 127.0.0.1 port."""

    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def fresh(stack: T, *engines: FakeEngine) -> T:
    """``stack`` (a module's fake engines and proxies) with ``engines`` reset, as a test should find them."""
    for engine in engines:
        engine.reset()
    return stack


def stop_all(*served: Served) -> None:
    """Stop every server of ``served``."""
    for s in served:
        s.stop()
