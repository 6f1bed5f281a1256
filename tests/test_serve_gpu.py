"""`atomflow serve` on the CUDA backend (skipped without a GPU): streaming through the pipelined
decode, a chat's second turn reusing the cache, and a dropped stream ending the CUDA run."""

import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from serve_util import Server  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def server(tiny_model_file, tmp_path_factory):
    with Server(tiny_model_file, tmp_path_factory.mktemp("serve"), "--backend", "cuda", "--max-context", "4096") as s:
        yield s


def test_cuda_stream_reuse_and_cancel(server):
    assert httpx.get(server.url + "/health").json()["backend"] == "cuda"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Explain the key-value cache in a few sentences, please. " * 8}]
    kw = dict(model="tiny", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(messages=msgs, **kw)
    chunks = list(client.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 32
    msgs += [{"role": "assistant", "content": whole.choices[0].message.content}, {"role": "user", "content": "And why?"}]
    r2 = client.chat.completions.create(messages=msgs, **kw)
    assert r2.usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens

    body = {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data:")
            if n >= 20:
                break
    t0 = time.perf_counter()
    server.wait_idle(limit=1.0)
    print(f"engine free {1e3 * (time.perf_counter() - t0):.1f} ms after the client left")
    assert client.completions.create(model="tiny", prompt="next", max_tokens=4).usage.completion_tokens >= 1
