"""Splitting completions batches into one request per prompt and merging the answers back (pure functions)."""

from __future__ import annotations

import asyncio
import json

import pytest

from p2pkv.tools.proxy.batch import StreamMerger, merge_completions, split_prompts, sse_events
from p2pkv.tools.proxy.validate import BadRequest, check_request


def test_split_every_prompt_shape() -> None:
    assert split_prompts({"prompt": "a"}) == [{"prompt": "a"}]
    assert split_prompts({"prompt": [1, 2, 3]}) == [{"prompt": [1, 2, 3]}]  # token ids: one prompt
    assert split_prompts({"prompt": ["a"], "x": 1}) == [{"prompt": "a", "x": 1}]
    assert split_prompts({"prompt": ["a", "b"]}) == [{"prompt": "a"}, {"prompt": "b"}]
    assert split_prompts({"prompt": [[1], [2, 3]]}) == [{"prompt": [1]}, {"prompt": [2, 3]}]
    assert split_prompts({"messages": []}) == [{"messages": []}]
    with pytest.raises(BadRequest, match="prompt"):
        split_prompts({"prompt": []})


@pytest.mark.parametrize(("field", "value"), [("n", 2), ("best_of", 3)])
def test_several_sequences_refused_naming_the_field(field: str, value: int) -> None:
    check_request("/v1/completions", {field: 1})
    with pytest.raises(BadRequest, match=field):
        check_request("/v1/completions", {field: value})


def test_merge_reindexes_and_sums_usage() -> None:
    answers = [{"id": "a", "choices": [{"index": 0, "text": t}],
                "usage": {"prompt_tokens": p, "completion_tokens": 2, "total_tokens": p + 2}}
               for t, p in (("x", 3), ("y", 5))]
    merged = merge_completions(answers)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "x"), (1, "y")]
    assert merged["usage"] == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}
    assert merged["id"] == "a"


def test_stream_merge_rewrites_indices_and_sends_one_usage_and_done() -> None:
    async def chunks(events: list[str]):
        for e in events:
            yield f"data: {e}\n\n".encode()

    def stream(text: str, n: int) -> list[str]:
        return [json.dumps({"id": f"id{n}", "choices": [{"index": 0, "text": text}]}),
                json.dumps({"id": f"id{n}", "choices": [], "usage": {"prompt_tokens": n, "completion_tokens": 1,
                                                                      "total_tokens": n + 1}}), "[DONE]"]

    async def run() -> list[bytes]:
        merger, out = StreamMerger(), []
        for index, text in enumerate(("a", "b")):
            async for data in sse_events(chunks(stream(text, index + 1))):
                if (b := merger.chunk(index, data)) is not None:
                    out.append(b)
        return [*out, merger.end()]

    out = asyncio.run(run())
    events = [json.loads(line[6:]) for b in out for line in b.decode().split("\n\n")
              if line.startswith("data: {")]
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events if e["choices"]] == [(0, "a"),
                                                                                                 (1, "b")]
    (usage,) = [e["usage"] for e in events if not e["choices"]]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert {e["id"] for e in events} == {"id1"}
    assert b"".join(out).count(b"[DONE]") == 1
