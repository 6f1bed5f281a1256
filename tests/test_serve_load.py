"""A bounded load test on loopback: 64 concurrent clients, a few hundred requests against a queue
of 8. Every request is answered (200) or cleanly refused (503 queue full with Retry-After, 504
waited too long); nothing hangs, the server's memory stays flat, and it is healthy afterwards."""

import asyncio
import collections
import http.client
import json
import random
import time
import urllib.parse

import httpx
import pytest
from serve_util import Server

CLIENTS, REQUESTS = 64, 320


@pytest.fixture(scope="module")
def server(tiny_model_file, tmp_path_factory):
    with Server(
        tiny_model_file, tmp_path_factory.mktemp("serve"), "--max-context", "4096", "--queue", "8", "--request-timeout", "0.3"
    ) as s:
        yield s


async def one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    rnd = random.Random(i)
    stream = rnd.random() < 0.5
    if rnd.random() < 0.5:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"request {i}"}]}
    else:
        path, body = "/v1/completions", {"prompt": [rnd.randrange(1, 1000) for _ in range(rnd.randrange(1, 64))]}
    body.update(max_tokens=rnd.randrange(1, 12), stream=stream, ignore_eos=True, seed=i)
    if stream:
        async with client.stream("POST", url + path, json=body) as r:
            text = (await r.aread()).decode()
            if r.status_code == 200:
                assert text.rstrip().endswith("data: [DONE]"), text[-200:]
            return r.status_code, text if r.status_code != 503 else r.headers.get("retry-after", "")
    r = await client.post(url + path, json=body)
    if r.status_code == 200:
        assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    return r.status_code, r.text if r.status_code != 503 else r.headers.get("retry-after", "")


async def hammer(url: str, n: int, first: int = 0) -> list[tuple[int, str]]:
    sem = asyncio.Semaphore(CLIENTS)
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60), limits=limits) as client:

        async def bounded(i):
            async with sem:
                return await one(client, url, i)

        return await asyncio.gather(*(bounded(first + i) for i in range(n)))


def test_64_clients(server):
    warm = asyncio.run(hammer(server.url, CLIENTS))  # warm-up: allocator pools, imports, caches
    server.wait_idle(5)
    rss0 = server.rss_kib()
    t0 = time.perf_counter()
    results = asyncio.run(asyncio.wait_for(hammer(server.url, REQUESTS, first=CLIENTS), timeout=240))
    elapsed = time.perf_counter() - t0
    server.wait_idle(5)
    rss1 = server.rss_kib()
    count = collections.Counter(status for status, _ in results + warm)
    print(f"{REQUESTS} requests in {elapsed:.1f} s: {dict(count)}; RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB")
    assert set(count) <= {200, 503, 504}, count
    assert count[200] >= 8 and count[503] > 0  # some ran, the queue bound held
    assert all(retry == "1" for status, retry in results if status == 503)
    assert rss1 - rss0 < 32 * 1024, f"RSS grew {rss0} -> {rss1} KiB"
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and not h["busy"] and h["queued"] == 0
    metrics = server.get("/metrics").text
    assert "atomflow_queue_depth 0.0" in metrics and "atomflow_running 0.0" in metrics


def test_an_idle_connection_outlives_the_client_pools(server):
    """A keep-alive connection idle for longer than a client pool keeps one (httpx: 5 s) still takes the
    next request: the server must not close it first (a close racing the client's reuse fails that
    request with a read error on the client's side)."""
    u = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        for i in range(2):
            if i:
                time.sleep(6)
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    finally:
        conn.close()


def test_waiting_past_the_timeout_is_504(server):
    """One long stream holds the engine (seconds); a request behind it waits 0.3 s, then gets its
    504; the stream is dropped (cancelled) and the next request runs."""
    long = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=long) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator closes the response
        next(lines)
        t0 = time.perf_counter()
        late = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        waited = time.perf_counter() - t0
        assert late.status_code == 504 and late.json()["error"]["code"] == "queue_timeout"
        assert 0.25 < waited < 2.0
    server.wait_idle(2)
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
