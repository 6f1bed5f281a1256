"""Malformed and refused requests: each gets its status and an OpenAI error object naming what
is wrong; never a 500, never a traceback. Unknown fields are refused (400), as OpenAI does."""

import pytest
from serve_util import Server

KEY = "k-errors"
CTX = 256
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_file, tmp_path_factory):
    with Server(
        tiny_model_file, tmp_path_factory.mktemp("serve"), "--max-context", str(CTX), "--max-tokens", "100", api_key=KEY
    ) as s:
        yield s


def chat(**kw):
    return {"model": "tiny", "messages": MSG, "max_tokens": 2, **kw}


# (path, body: dict | bytes, status, param or None, words the message must contain)
CASES = {
    "bad json": (CHAT, b'{"messages": [', 400, None, "malformed JSON"),
    "not an object": (CHAT, b"[1, 2]", 400, None, "JSON object"),
    "not utf-8": (CHAT, b"\xff\xfe{", 400, None, "malformed JSON"),
    "messages not a list": (CHAT, chat(messages="hi"), 400, "messages", "messages"),
    "empty messages": (CHAT, chat(messages=[]), 400, "messages", "messages"),
    "message without role": (CHAT, chat(messages=[{"content": "hi"}]), 400, "messages.0.role", "role"),
    "unknown role": (CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages.0.role", "role"),
    "content of a wrong type": (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content", "content"),
    "image content": (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages.0.content",
        "content",
    ),
    "negative max_tokens": (CHAT, chat(max_tokens=-1), 400, "max_tokens", "greater than or equal to 1"),
    "zero max_completion_tokens": (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", "greater"),
    "max_tokens a string": (CHAT, chat(max_tokens="10"), 400, "max_tokens", "integer"),
    "max_tokens a float": (CHAT, chat(max_tokens=2.5), 400, "max_tokens", "integer"),
    "temperature -1": (CHAT, chat(temperature=-1), 400, "temperature", "greater than or equal to 0"),
    "temperature a string": (CHAT, chat(temperature="hot"), 400, "temperature", "number"),
    "top_p 0": (CHAT, chat(top_p=0), 400, "top_p", "greater than 0"),
    "top_p 1.5": (CHAT, chat(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    "top_k -2": (CHAT, chat(top_k=-2), 400, "top_k", "greater than or equal to -1"),
    "seed -1": (CHAT, chat(seed=-1), 400, "seed", "greater than or equal to 0"),
    "stream a string": (CHAT, chat(stream="yes"), 400, "stream", "boolean"),
    "five stop strings": (CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    "empty stop string": (CHAT, chat(stop=""), 400, "stop", "non-empty"),
    "unknown field": (CHAT, chat(frobnicate=1), 400, "frobnicate", "Unrecognized request argument"),
    "a template in the request": (CHAT, chat(chat_template="{{ 7*7 }}"), 400, "chat_template", "Unrecognized"),
    "n 2": (CHAT, chat(n=2), 400, "n", "n > 1"),
    "tools": (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "tools"),
    "logprobs": (CHAT, chat(logprobs=True), 400, "logprobs", "logprobs"),
    "top_logprobs": (CHAT, chat(top_logprobs=3), 400, "top_logprobs", "logprobs"),
    "json mode": (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format", "response_format"),
    "tool message": (CHAT, chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), 400, "messages[0]", "tool"),
    "unknown model": (CHAT, chat(model="gpt-4o"), 404, "model", "does not exist"),
    "max_tokens past --max-tokens": (CHAT, chat(max_tokens=101), 400, "max_tokens", "at most 100"),
    "prompt past the context": (
        CHAT,
        chat(messages=[{"role": "user", "content": "cache " * 400}]),
        400,
        "messages",
        f"maximum context length is {CTX}",
    ),
    "prompt + max_tokens past the context": (
        COMP,
        {"prompt": list(range(1, 200)), "max_tokens": 60},
        400,
        "max_tokens",
        f"maximum context length is {CTX}",
    ),
    "completion prompt past the context": (COMP, {"prompt": [5] * (CTX + 1)}, 400, "prompt", f"maximum context length is {CTX}"),
    "missing prompt": (COMP, {"max_tokens": 2}, 400, "prompt", "Missing required parameter"),
    "empty prompt": (COMP, {"prompt": ""}, 400, "prompt", "empty"),
    "token id out of range": (COMP, {"prompt": [1, 10**6]}, 400, "prompt", "out of range"),
    "prompt ids of a wrong type": (COMP, {"prompt": [1, "a", 2.5]}, 400, "prompt", "prompt"),
    "two prompts": (COMP, {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    "echo": (COMP, {"prompt": "a", "echo": True}, 400, "echo", "echo"),
    "huge body": (CHAT, b'{"messages": [{"role": "user", "content": "' + b"x" * (5 << 20) + b'"}]}', 413, None, "too large"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_request(server, name):
    path, body, status, param, words = CASES[name]
    if isinstance(body, bytes):
        r = server.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.post(path, json=body)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert words in err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and err["type"]
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text


def test_huge_body_without_content_length(server):
    """A chunked body has no Content-Length: it is counted as it arrives."""

    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"x" * (64 << 10)
        yield b'"}]}'

    r = server.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]


@pytest.mark.parametrize("method,path,status", [("GET", CHAT, 405), ("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405)])
def test_wrong_routes(server, method, path, status):
    import httpx

    r = httpx.request(method, server.url + path, headers=server.headers)
    assert r.status_code == status and r.json()["error"]["message"]


def test_template_text_is_data(server):
    """Message text that looks like jinja is rendered as text (the template runs in jinja's
    sandbox; requests cannot supply one)."""
    plain = server.post(CHAT, json=chat(messages=[{"role": "user", "content": "{{ 7*7 }}"}], max_tokens=1)).json()
    assert plain["usage"]["prompt_tokens"] > 5 and plain["choices"][0]["finish_reason"] in ("length", "stop")


def test_no_traceback_in_the_log(server):
    server.post(CHAT, json=chat())
    assert server.get("/health").status_code == 200
    assert "Traceback" not in server.log()
