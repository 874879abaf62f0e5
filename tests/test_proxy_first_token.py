"""The proxy's first token from the prefill engine: which requests qualify, the stream the client sees, the
decode leg's request, and failures after the first token went out (fake engines over real HTTP on 127.0.0.1;
the end-to-end run against real engines is in ``test_e2e_first_token.py``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from p2pkv.tools.proxy import create_app
from p2pkv.tools.proxy.first_token import (
    Fallback,
    FirstTokenStream,
    blocker,
    decode_body,
    first_token_or_fallback,
    read_first_token,
    request_fallback,
)
from p2pkv.tools.proxy.validate import CHAT, COMPLETIONS
from tests.fake_engines import PROMPT_IDS, FakeEngine, Served, p2pkv_prefill_answer
from tests.test_proxy import metric


@pytest.mark.parametrize(("body", "reason"), [
    ({"prompt": "hi", "stream": True}, None),
    ({"prompt": [1, 2, 3], "stream": True, "temperature": 0, "seed": 3}, None),
    ({"prompt": ["hi"], "stream": True, "stop": [], "logprobs": None, "stream_options": {"include_usage": True}},
     None),
    ({"prompt": "hi"}, "not streamed"),
    ({"prompt": ["a", "b"], "stream": True}, "several prompts"),
    ({"prompt": "hi", "stream": True, "stop": ["\n"]}, "stop"),
    ({"prompt": "hi", "stream": True, "logprobs": 2}, None),
    ({"prompt": "hi", "stream": True, "prompt_logprobs": 2}, "prompt_logprobs"),
    ({"prompt": "hi", "stream": True, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "hi", "stream": True, "min_tokens": 4}, "min_tokens"),
    ({"prompt": "hi", "stream": True, "echo": True}, "echo"),
    ({"prompt": "hi", "stream": True, "seed": 3}, "seeded sampling"),
    ({"prompt": "hi", "stream": True, "seed": 3, "temperature": 0.7}, "seeded sampling"),
])
def test_which_completions_requests_take_the_prefill_token(body: dict, reason: str | None) -> None:
    assert blocker(COMPLETIONS, body) == reason


def test_which_chat_requests_take_the_prefill_token() -> None:
    text = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": True}
    assert blocker(CHAT, text) is None
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
             "stream": True}
    assert blocker(CHAT, image) == "non-text message content"
    assert blocker(CHAT, {**text, "tools": [{"type": "function"}]}) == "tools"
    assert blocker(CHAT, {**text, "response_format": {"type": "json_object"}}) == "response_format"
    assert blocker("/v1/embeddings", text) is not None


def _answer(path: str, **choice: Any) -> dict[str, Any]:
    answer = p2pkv_prefill_answer(path)
    answer["choices"][0].update(choice)
    return answer


def test_read_first_token_and_when_it_falls_back() -> None:
    body = {"prompt": "hi", "stream": True, "max_tokens": 5}
    first = read_first_token(COMPLETIONS, body, _answer(COMPLETIONS))
    assert first is not None and (first.token_id, first.text, first.finish_reason) == (7, "x", None)
    assert first.prompt_token_ids == PROMPT_IDS and (first.id, first.created, first.model) == ("cmpl-p", 11, "tiny")
    assert read_first_token(COMPLETIONS, {**body, "max_tokens": 1}, _answer(COMPLETIONS)).finish_reason == "length"
    eos = read_first_token(COMPLETIONS, body, _answer(COMPLETIONS, finish_reason="stop", text=""))
    assert eos is not None and eos.finish_reason == "stop"  # ends here: an empty text is the answer
    # the answers that fall back, each with its reason: test_each_fallback_names_its_reason
    chat = read_first_token(CHAT, body, _answer(CHAT))
    assert chat is not None and chat.text == "x" and chat.prompt_token_ids == PROMPT_IDS
    parsed = _answer(CHAT, message={"role": "assistant", "content": None, "reasoning": "x"})
    assert read_first_token(CHAT, body, parsed) is None  # a reasoning parser ran: fall back


def test_each_fallback_names_its_reason() -> None:
    body = {"prompt": "hi", "stream": True, "max_tokens": 5}
    cases = [
        (COMPLETIONS, _answer(COMPLETIONS, text=""), Fallback.PARTIAL_CHARACTER),
        (COMPLETIONS, _answer(COMPLETIONS, text="\ufffd"), Fallback.PARTIAL_CHARACTER),
        (COMPLETIONS, _answer(COMPLETIONS, token_ids=None), Fallback.PREFILL_ANSWER),
        (COMPLETIONS, _answer(COMPLETIONS, token_ids=[7, 8]), Fallback.PREFILL_ANSWER),
        (COMPLETIONS, _answer(COMPLETIONS, finish_reason="abort"), Fallback.FINISH_REASON),
        (CHAT, _answer(CHAT, message={"role": "assistant", "content": None, "tool_calls": [{}]}), Fallback.PARSER),
    ]
    for params in ({"first_token": False}, {"kv_connector": "NixlConnector"}):
        answer = _answer(COMPLETIONS)
        answer["kv_transfer_params"].update(params)
        cases.append((COMPLETIONS, answer, Fallback.PREFILL_ANSWER))
    for path, answer, reason in cases:
        assert first_token_or_fallback(path, body, answer) is reason, (answer, reason)
        assert read_first_token(path, body, answer) is None
    assert first_token_or_fallback(COMPLETIONS, body, _answer(COMPLETIONS)) == read_first_token(
        COMPLETIONS, body, _answer(COMPLETIONS))
    assert request_fallback(COMPLETIONS, body, "prefill") is None
    assert request_fallback(COMPLETIONS, body, "decode") is Fallback.CONFIG
    assert request_fallback(COMPLETIONS, {**body, "stop": ["\n"]}, "prefill") is Fallback.REQUEST
    assert request_fallback(COMPLETIONS, {**body, "prompt": ["a", "b"]}, "prefill") is Fallback.REQUEST
    assert request_fallback(COMPLETIONS, {**body, "seed": 3}, "prefill") is Fallback.SAMPLING


def test_decode_body_continues_after_the_first_token() -> None:
    params = {"remote_block_ids": [[1]], "remote_num_tokens": 3}
    body = {"prompt": "hi", "max_tokens": 5, "stream": True}
    first = read_first_token(COMPLETIONS, body, _answer(COMPLETIONS))
    out = decode_body(COMPLETIONS, body, first, params)
    assert out["prompt"] == [*PROMPT_IDS, 7] and out["max_tokens"] == 4
    assert out["kv_transfer_params"] == {**params, "appended_tokens": 1} and body["max_tokens"] == 5
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    out = decode_body(CHAT, chat_body, first, params)
    assert out["messages"] == chat_body["messages"] and out["max_completion_tokens"] == 2
    assert out["kv_transfer_params"]["prompt_token_ids"] == [*PROMPT_IDS, 7]
    assert "max_tokens" not in decode_body(COMPLETIONS, {"prompt": "hi"}, first, params)  # the engine's default


def _events(raw: bytes) -> list[Any]:
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in raw.decode().split("\n\n") if e]


def test_stream_counts_usage_against_the_clients_prompt_and_keeps_one_id() -> None:
    body = {"prompt": "hi", "stream": True, "max_tokens": 3, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    first = read_first_token(COMPLETIONS, body, _answer(COMPLETIONS))
    writer = FirstTokenStream(COMPLETIONS, body, first)
    (opening,) = _events(writer.opening())
    assert opening["id"] == "cmpl-p" and opening["choices"][0]["text"] == "x"
    assert opening["choices"][0]["prompt_token_ids"] == PROMPT_IDS and opening["choices"][0]["token_ids"] == [7]
    assert opening["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert opening["choices"][0]["logprobs"] is None  # not asked for
    decode_chunk = {"id": "cmpl-d", "created": 12, "choices": [{"index": 0, "text": "y", "token_ids": [8],
                    "prompt_token_ids": [*PROMPT_IDS, 7]}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    (chunk,) = _events(writer.rewrite(json.dumps(decode_chunk)))
    assert chunk["id"] == "cmpl-p" and chunk["created"] == 11 and "prompt_token_ids" not in chunk["choices"][0]
    assert chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    with_logprobs = {"id": "cmpl-d", "choices": [{"index": 0, "text": "zz", "logprobs": {
        "text_offset": [1], "tokens": ["zz"], "token_logprobs": [-0.5], "top_logprobs": None}}]}
    (chunk,) = _events(writer.rewrite(json.dumps(with_logprobs)))
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [2]  # after "x", the first token's text
    final = {"id": "cmpl-d", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    assert writer.rewrite(json.dumps(final)) is None and writer.rewrite("[DONE]") is None
    usage, done = _events(writer.closing(writer.usage_chunk))
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6} and done == "[DONE]"


def test_first_chunk_carries_the_prefill_answers_logprobs() -> None:
    logprobs = {"content": [{"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}]}
    first = read_first_token(CHAT, {"stream": True}, _answer(CHAT, logprobs=logprobs))
    _, content = _events(FirstTokenStream(CHAT, {"stream": True, "logprobs": True}, first).opening())
    assert content["choices"][0]["logprobs"] == logprobs


def test_chat_stream_opens_with_one_role_chunk() -> None:
    body = {"messages": [], "stream": True, "max_tokens": 1, "stream_options": {"include_usage": True}}
    first = read_first_token(CHAT, body, _answer(CHAT))
    writer = FirstTokenStream(CHAT, body, first)
    role, content, usage, done = _events(writer.opening())  # max_tokens 1: the whole answer
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content["choices"][0]["delta"] == {"content": "x"} and content["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 1 and done == "[DONE]"
    decode_role = {"id": "d", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None}]}
    assert writer.rewrite(json.dumps(decode_role)) is None  # the decode engine's own opening is dropped


@pytest.fixture(scope="module")
def engines():
    prefill, decode = FakeEngine("p", "prefill"), FakeEngine("d", "decode")
    served = [Served(prefill.app), Served(decode.app)]
    early = Served(create_app([served[0].url], [served[1].url], 10.0))
    late = Served(create_app([served[0].url], [served[1].url], 10.0, first_token_from="decode"))
    yield prefill, decode, early.url, late.url
    for s in (early, late, *served):
        s.stop()


@pytest.fixture
def pd(engines):
    prefill, decode, *_ = engines
    prefill.reset()
    decode.reset()
    prefill.mode = "p2pkv"
    yield engines
    decode.gate.set()


def test_first_token_reaches_the_client_before_the_decode_engine_answers(pd) -> None:
    prefill, decode, proxy, _ = pd
    decode.mode = "held"
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    with httpx.Client(timeout=10) as client, client.stream("POST", f"{proxy}/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] == "x"
        assert not decode.gate.is_set()  # the decode engine has not answered anything yet
        decode.gate.set()
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
        assert [c["choices"][0]["text"] for c in rest] == ["a", "b", "c"]
        assert {c.get("id") for c in rest} == {"cmpl-p"}
    assert prefill.seen[0]["body"]["return_token_ids"] is True
    sent = decode.seen[0]["body"]
    assert sent["prompt"] == [*PROMPT_IDS, 7] and sent["max_tokens"] == 3
    assert sent["kv_transfer_params"]["appended_tokens"] == 1
    metrics = httpx.get(f"{proxy}/metrics").text
    assert metric(metrics, "p2pkv_proxy_first_tokens_total", source="prefill") >= 1
    assert 'p2pkv_proxy_first_tokens_total{source="decode"}' in metrics  # exported at 0 too
    for reason in Fallback:  # every reason is exported from the start
        assert f'p2pkv_proxy_first_token_fallbacks_total{{reason="{reason.value}"}}' in metrics


def test_one_token_answer_never_asks_the_decode_engine(pd) -> None:
    _, decode, proxy, _ = pd
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
    resp = httpx.post(f"{proxy}/v1/chat/completions", json=body, timeout=10)
    events = _events(resp.content)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert decode.seen == []


def test_decode_failure_after_the_first_token_ends_the_stream_with_an_error(pd) -> None:
    _, decode, proxy, _ = pd
    for mode, status in (("500", 502), ("400", 400)):
        decode.mode = mode
        body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
        events = _events(httpx.post(f"{proxy}/v1/completions", json=body, timeout=10).content)
        assert events[0]["choices"][0]["text"] == "x"
        assert events[1]["error"]["code"] == status and events[1]["error"]["stage"] == "decode"
        assert events[-1] == "[DONE]"


def test_fallbacks_send_the_decode_engine_the_clients_prompt(pd) -> None:
    prefill, decode, proxy, late = pd
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    for url, extra in ((proxy, {"stop": ["\n"]}), (late, {})):
        decode.seen.clear()
        prefill.seen.clear()
        text = "".join(e["choices"][0]["text"] for e in _events(
            httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=10).content) if e != "[DONE]")
        assert text == "abc"  # the decode engine's stream as it is
        assert "return_token_ids" not in prefill.seen[0]["body"]
        assert decode.seen[0]["body"]["prompt"] == "hi" and "appended_tokens" not in \
            decode.seen[0]["body"]["kv_transfer_params"]
    prefill.seen.clear()
    prefill.mode = "ok"  # a prefill engine that is not p2pkv's (no first_token): its answer is not used
    text = "".join(e["choices"][0]["text"] for e in _events(
        httpx.post(f"{proxy}/v1/completions", json=body, timeout=10).content) if e != "[DONE]")
    assert text == "abc" and prefill.seen[0]["body"]["return_token_ids"] is True
