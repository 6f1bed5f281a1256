"""`atomflow serve` against the official openai client: a real server process on loopback (CPU
backend, the tiny model), chat and completions, streaming and not, stop strings, seeds, prefix
reuse across chat turns, client disconnects, and the API key."""

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
from serve_util import Server  # noqa: E402

KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(tiny_model_file, tmp_path_factory):
    with Server(tiny_model_file, tmp_path_factory.mktemp("serve"), "--max-context", "4096", api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, content="Tell me about caches.", **kw):
    kw.setdefault("max_tokens", 16)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = httpx.get(server.url + "/health").json()  # no key needed for /health
    assert h["status"] == "ok" and h["backend"] == "cpu" and h["max_context"] == 4096


def test_chat_non_streaming(client):
    r = chat(client, max_tokens=12, extra_body={"ignore_eos": True}, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.model == "tiny" and c.message.role == "assistant"
    assert c.finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 5 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert isinstance(c.message.content, str)


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = chat(client, "Stream this", **kw).choices[0].message.content
    chunks = list(chat(client, "Stream this", stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole and finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_completions_text_and_token_ids(client):
    r = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    ids = client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 6
    streamed = client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == ids.choices[0].text


def test_stop_strings(client):
    kw = dict(max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    text = chat(client, "A story", **kw).choices[0].message.content
    stop = next(
        (
            text[i : i + 2]
            for i in range(len(text) // 3, len(text) - 2)
            if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
        ),
        None,
    )
    if stop is None:
        pytest.skip(f"no usable stop string in {text!r}")
    for stream in (False, True):
        r = chat(client, "A story", stop=[stop, "never-there"], stream=stream, **kw)
        if stream:
            chunks = list(r)
            cut = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
        else:
            cut, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert cut == text[: text.index(stop)] and finish == "stop"
    r = client.completions.create(model="tiny", prompt="A story", stop=stop, **kw)
    assert stop not in r.choices[0].text


def test_seed_determinism(client):
    def run(seed):
        return (
            chat(client, "Pick words", max_tokens=16, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
            .choices[0]
            .message.content
        )

    a, b = run(7), run(7)
    assert a == b
    assert run(8) != a or run(9) != a


def test_turn_two_prefills_only_its_new_tokens(server, client):
    msgs = [{"role": "user", "content": "Explain the key-value cache in a few sentences, please. " * 8}]
    r1 = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    msgs += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And why does it help?"},
    ]
    before = server.metric("atomflow_prefilled_tokens_total")
    reused_before = server.metric("atomflow_reused_prefix_tokens_total")
    r2 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens  # all of turn 1's prompt, and what of the reply re-encodes alike
    prefilled = server.metric("atomflow_prefilled_tokens_total") - before
    assert prefilled == r2.usage.prompt_tokens - cached < r2.usage.prompt_tokens - r1.usage.prompt_tokens + 1
    assert server.metric("atomflow_reused_prefix_tokens_total") - reused_before == cached


def test_disconnect_mid_stream_frees_the_engine(server, client):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Go on forever"}],
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    gen_before = server.metric("atomflow_generated_tokens_total")
    cancelled_before = server.metric("atomflow_cancelled_requests_total")
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data:")
                if n >= 5:
                    break
    latency = server.wait_idle(limit=2.0)  # the connection is closed here
    print(f"engine free {1e3 * latency:.1f} ms after the client left (streaming)")
    assert server.metric("atomflow_cancelled_requests_total") == cancelled_before + 1
    assert server.metric("atomflow_generated_tokens_total") - gen_before < 1000  # stopped long before 3000
    assert chat(client, max_tokens=3).choices[0].finish_reason in ("length", "stop")  # the next one runs


def test_disconnect_while_not_streaming_frees_the_engine(server, client):
    body = {"model": "tiny", "prompt": "Keep going", "max_tokens": 3000, "ignore_eos": True}
    cancelled_before = server.metric("atomflow_cancelled_requests_total")
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as c:
            c.post(server.url + "/v1/completions", json=body, headers=server.headers)
    latency = server.wait_idle(limit=2.0)
    print(f"engine free {1e3 * latency:.1f} ms after the client left (not streaming)")
    assert server.metric("atomflow_cancelled_requests_total") == cancelled_before + 1
    assert client.completions.create(model="tiny", prompt="next", max_tokens=2).usage.completion_tokens >= 1


def test_api_key(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics").status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics(server):
    text = server.get("/metrics").text
    for name in (
        "atomflow_requests_total",
        "atomflow_prompt_tokens_total",
        "atomflow_generated_tokens_total",
        "atomflow_time_to_first_token_seconds_bucket",
        "atomflow_time_per_output_token_seconds_bucket",
        "atomflow_queue_depth",
        "atomflow_reused_prefix_tokens_total",
    ):
        assert name in text, name
    assert 'atomflow_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert json.loads(server.get("/health").text)["busy"] is False


def test_a_client_leaving_the_queue_frees_its_place(server):
    """A request waiting behind a long stream, whose client gives up, leaves the queue at once and
    never runs."""
    long = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=long, headers=server.headers) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the response
        next(lines)
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as q:
                q.post(server.url + "/v1/completions", json={"prompt": "queued", "max_tokens": 5}, headers=server.headers)
        t0 = time.perf_counter()
        while True:
            h = httpx.get(server.url + "/health").json()
            if h["queued"] == 0:
                break
            assert time.perf_counter() - t0 < 2.0, "the abandoned request still waits"
            time.sleep(0.01)
        assert h["busy"]  # the long stream still runs
    server.wait_idle(limit=2.0)
