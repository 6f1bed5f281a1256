"""`atomflow serve` as a command: one-line errors before it binds, loopback by default, /health
503 while the model loads (the app in-process, its load held back)."""

import subprocess
import sys
import threading

import pytest

pytest.importorskip("fastapi")


def serve(*args):
    return subprocess.run(
        [sys.executable, "-m", "atomflow.cli", "serve", *map(str, args)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["{missing}"], "no such model file"),
        (["{model}", "--queue", "-1"], "--queue -1 is out of range"),
        (["{model}", "--request-timeout", "0"], "--request-timeout 0.0 is out of range"),
        (["{model}", "--port", "70000"], "--port 70000 is out of range"),
        (["{model}", "--port", "0", "--backend", "cpu", "--max-context", "100000000"], "max_context must be an integer"),
    ],
)
def test_bad_options_are_one_line(tiny_model_file, tmp_path, args, needle):
    r = serve(*[a.format(missing=tmp_path / "nope.atomflow", model=tiny_model_file) for a in args])
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("atomflow: error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_binds_loopback_by_default():
    from atomflow.cli import build_parser

    a = build_parser().parse_args(["serve", "m.atomflow"])
    assert a.host == "127.0.0.1" and a.port == 8080 and a.queue == 16


def test_health_is_503_while_loading(tiny_model_file):
    from fastapi.testclient import TestClient

    from atomflow import Engine
    from atomflow.serve.app import ServeConfig, create_app

    go = threading.Event()

    def slow_load():
        go.wait(30)
        return Engine.load(tiny_model_file, backend="cpu", max_context=128)

    app = create_app(ServeConfig(model=str(tiny_model_file), model_name="tiny"), load=slow_load)
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
        go.set()
        app.state.worker.loaded.wait(30)
        assert client.get("/health").json()["status"] == "ok"
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_failed_load_is_reported(tmp_path):
    from fastapi.testclient import TestClient

    from atomflow.serve.app import ServeConfig, create_app

    def broken():
        raise ValueError("max_context must be an integer in [1, 16384]")

    app = create_app(ServeConfig(model="x.atomflow", model_name="x"), load=broken)
    with TestClient(app) as client:
        app.state.worker.loaded.wait(30)
        r = client.get("/health")
        assert r.status_code == 503 and "max_context" in r.json()["message"]
        assert client.get("/v1/models").json()["error"]["code"] == "model_load_failed"


def test_queue_zero_still_runs_one(tiny_model_file):
    """--queue 0: no request waits, but one still runs when the engine is free."""
    from fastapi.testclient import TestClient

    from atomflow import Engine
    from atomflow.serve.app import ServeConfig, create_app

    app = create_app(
        ServeConfig(model=str(tiny_model_file), model_name="tiny", max_queue=0),
        load=lambda: Engine.load(tiny_model_file, backend="cpu", max_context=128),
    )
    with TestClient(app) as client:
        app.state.worker.loaded.wait(30)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text


def test_an_engine_failure_is_a_500_error_object_and_the_next_request_runs(tiny_model_file):
    from fastapi.testclient import TestClient

    from atomflow import Engine
    from atomflow.serve.app import ServeConfig, create_app

    eng = Engine.load(tiny_model_file, backend="cpu", max_context=128)
    real = eng.generate_tokens
    calls = []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 2:  # the second request fails (load= skips the warm-up)
            raise RuntimeError("device lost")
        return real(*args, **kw)

    eng.generate_tokens = flaky
    app = create_app(ServeConfig(model=str(tiny_model_file), model_name="tiny"), load=lambda: eng)
    with TestClient(app) as client:
        app.state.worker.loaded.wait(30)
        body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and "engine failed" in r.json()["error"]["message"]
        assert "Traceback" not in r.text and "device lost" not in r.text
        stream = client.post("/v1/completions", json={**body, "stream": True})
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")


def test_prefill_recipe_reaches_the_engine(tiny_model_file):
    """--prefill-recipe w8a8 (the FP8 prompt recipe) is the served engine's: here the CPU reference's emulation."""
    from fastapi.testclient import TestClient

    from atomflow.cli import build_parser
    from atomflow.serve.app import ServeConfig, create_app

    assert build_parser().parse_args(["serve", "m.atomflow"]).prefill_recipe == "w8a16"
    assert build_parser().parse_args(["serve", "m.atomflow", "--prefill-recipe", "w8a8"]).prefill_recipe == "w8a8"
    cfg = ServeConfig(model=str(tiny_model_file), model_name="tiny", backend="cpu", max_context=64, prefill_recipe="w8a8")
    app = create_app(cfg)
    with TestClient(app):
        assert app.state.worker.loaded.wait(60)
        assert app.state.worker.engine.backend.ref.prefill_recipe == "w8a8"
