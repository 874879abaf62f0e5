"""A streamed answer that closes what it reads however it ends: its last byte sent, the client gone mid-way, or
the client gone before the body's first byte (a body never iterated runs no ``finally`` of its own)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStream(StreamingResponse):
    """A :class:`StreamingResponse` that runs ``on_close`` once it is over, however it ends: its last byte sent,
    or the client gone, also before the body's first byte (when the body's own ``finally`` never runs).

    Args:
        content: the body.
        on_close: closes what the body reads (idempotent); shielded from the cancellation a disconnect causes.
        headers: extra response headers.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Any],
                 headers: dict[str, str] | None = None) -> None:
        self.on_close = on_close
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


__all__ = ["ClosingStream"]
