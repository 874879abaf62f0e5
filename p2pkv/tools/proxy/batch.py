"""Completions requests with several prompts: one prefill/decode pair per prompt, answers merged back.

vLLM returns ``kv_transfer_params`` for the first prompt of a batched
completions request only, so a batch cannot go through prefill and decode
as one request: the decode side would decode every prompt on the first
prompt's KV. The proxy sends each prompt on its own, and merges the answers
as one engine would have answered the batch: choice ``index`` = prompt
position, ``usage`` summed, one ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from p2pkv.tools.proxy.validate import BadRequest


def split_prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One request body per prompt of a completions request (``[body]`` for a single prompt).

    ``prompt`` may be a string, a list of strings, a list of token ids (one
    prompt) or a list of token-id lists.

    Raises:
        BadRequest: an empty prompt list.
    """
    prompt = body.get("prompt")
    if not isinstance(prompt, list):
        return [body]
    if not prompt:
        raise BadRequest("prompt is an empty list; send at least one prompt", "prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [body]  # one prompt given as token ids
    if len(prompt) == 1:
        return [{**body, "prompt": prompt[0]}]
    return [{**body, "prompt": p} for p in prompt]


def _sum_usage(usages: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [u for u in usages if u]
    if not present:
        return None
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    out: dict[str, Any] = {k: sum(int(u.get(k) or 0) for u in present) for k in keys}
    for k in present[0]:
        out.setdefault(k, present[0][k] if len(present) == 1 else None)
    return out


def merge_completions(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One completions answer from one answer per prompt, in prompt order."""
    merged = dict(answers[0])
    choices = []
    for index, answer in enumerate(answers):
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": index})
    merged["choices"] = choices
    merged["usage"] = _sum_usage([a.get("usage") for a in answers])
    return merged


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream (``[DONE]`` included)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data:"):
                    yield line[5:].strip()
    if buffer.strip().startswith(b"data:"):
        yield buffer.decode().strip()[5:].strip()


class StreamMerger:
    """Rewrites one prompt's stream chunks into the batch's stream.

    Each chunk's choices get the prompt's index and the batch's id; a chunk
    carrying only ``usage`` (``stream_options.include_usage``) is held back
    and summed into one usage chunk at the end; each ``[DONE]`` is dropped
    and one is sent after the last stream.
    """

    def __init__(self) -> None:
        self.batch_id: str | None = None
        self.usages: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}

    def chunk(self, index: int, data: str) -> bytes | None:
        """The bytes to send for one ``data:`` payload of prompt ``index`` (None: nothing now)."""
        if data == "[DONE]":
            return None
        try:
            obj = json.loads(data)
        except ValueError:
            return f"data: {data}\n\n".encode()
        if not isinstance(obj, dict):
            return f"data: {data}\n\n".encode()
        if self.batch_id is None:
            self.batch_id = obj.get("id")
        if "id" in obj:
            obj["id"] = self.batch_id
        choices = obj.get("choices")
        if not choices and obj.get("usage") is not None:
            self.usages.append(obj["usage"])
            self.last = obj
            return None
        for choice in choices or []:
            choice["index"] = index
        return f"data: {json.dumps(obj)}\n\n".encode()

    def end(self) -> bytes:
        """The batch's usage chunk (when the streams sent one) and ``[DONE]``."""
        out = b""
        if self.usages:
            final = {**self.last, "id": self.batch_id, "choices": [], "usage": _sum_usage(self.usages)}
            out += f"data: {json.dumps(final)}\n\n".encode()
        return out + b"data: [DONE]\n\n"
