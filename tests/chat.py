"""Chat completions as a client reads them, whole or streamed (test helper)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class ChatAnswer:
    """What a client takes from one chat answer: the assistant's text, each token's logprob (nats), and (a whole
    answer) the prompt's and the answer's token ids."""

    content: str
    logprobs: list[float]
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    def max_logprob_diff(self, other: ChatAnswer) -> float:
        """Largest absolute logprob difference over the common tokens."""
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=False)), default=0.0)


def chat(client: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int,
         stream: bool = False) -> ChatAnswer:
    """Greedy ``/v1/chat/completions`` of ``messages`` at ``url`` with logprobs, whole or streamed (``stream``: the
    deltas' text and logprobs joined).

    Raises:
        AssertionError: an HTTP error, an error event, or a stream that does not end with ``[DONE]``.
    """
    body: dict[str, Any] = {"model": "model", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "logprobs": True, "stream": stream, "return_token_ids": True}
    if not stream:
        resp = client.post(f"{url}/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        choice = answer["choices"][0]
        return ChatAnswer(choice["message"]["content"], [c["logprob"] for c in choice["logprobs"]["content"]],
                          answer.get("prompt_token_ids"), choice.get("token_ids"))
    content, logprobs, done = "", [], False
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event.get("choices") or []:
                content += choice.get("delta", {}).get("content") or ""
                logprobs += [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    assert done, "the stream ended without [DONE]"
    return ChatAnswer(content, logprobs)
