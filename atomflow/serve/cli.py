"""`atomflow serve MODEL`: the OpenAI-compatible server (options, startup, one-line errors)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from atomflow.model.recipe import PREFILL_RECIPE_HELP, PREFILL_RECIPES

# How long an idle keep-alive connection stays open. Longer than the client pools' expiry (httpx, and so
# the openai client: 5 s): a server that closes first races a client reusing the connection at that
# instant, and the request fails on the client's side (a ReadError), not here. uvicorn's default is 5 s.
KEEP_ALIVE_S = 30


def register(subparsers) -> None:
    s = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (chat page at /)",
        description="Serves /v1/chat/completions, /v1/completions (SSE streaming), /v1/models, /health, /metrics "
        "and a chat page at /. One stream at a time from a bounded FIFO; a request sharing a prefix "
        "with the cache prefills only the rest.",
    )
    s.add_argument("model", help=".atomflow file")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    s.add_argument("--max-context", type=int, default=None, help="KV cache length (default min(8192, model))")
    s.add_argument("--queue", type=int, default=16, help="requests that may wait while one runs (default 16); more get 503")
    s.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds a request may wait in the queue before a 504 (default 300)"
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("ATOMFLOW_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $ATOMFLOW_API_KEY)",
    )
    s.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="the most tokens one request may generate (default 4096; also the default max_tokens, within the context)",
    )
    s.add_argument("--model-name", default=None, help="the model id clients send (default: the file's stem)")
    s.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    s.add_argument("--eager", action="store_true", help="CUDA: run without the CUDA graph")
    s.add_argument(
        "--speculate",
        default=None,
        metavar="ngram[:K]",
        help="speculative decoding with n-gram drafts, K drafted tokens at most (1..15, default 10); greedy only: "
        "requests default to temperature 0 and a temperature > 0 gets a 400",
    )
    s.add_argument("--prefill-recipe", choices=PREFILL_RECIPES, default="w8a16", help=PREFILL_RECIPE_HELP)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(fn=cmd_serve)


def cmd_serve(a) -> int:
    for name, v, ok in (
        ("--queue", a.queue, a.queue >= 0),
        ("--request-timeout", a.request_timeout, a.request_timeout > 0),
        ("--max-tokens", a.max_tokens, a.max_tokens >= 1),
        ("--port", a.port, 0 <= a.port < 65536),
        ("--max-context", a.max_context, a.max_context is None or a.max_context >= 2),  # a prompt token + one generated
    ):
        if not ok:
            raise ValueError(f"{name} {v} is out of range")
    from atomflow.speculate import parse_speculate

    spec = parse_speculate(a.speculate)
    try:
        import uvicorn

        from atomflow.serve.app import ServeConfig, create_app
    except ImportError as e:
        raise RuntimeError(
            f"atomflow serve needs fastapi, uvicorn, pydantic and prometheus-client (pip install 'atomflow[serve]'): {e}"
        ) from None
    from atomflow.model.fileformat import AtomflowFile

    AtomflowFile(a.model).close()  # a missing or corrupt file fails here, in one line, before binding
    name = a.model_name or Path(a.model).name.removesuffix(".atomflow")
    cfg = ServeConfig(
        model=a.model,
        model_name=name,
        max_context=a.max_context,
        backend=a.backend,
        max_queue=a.queue,
        request_timeout=a.request_timeout,
        api_key=a.api_key or None,
        max_tokens=a.max_tokens,
        eager=a.eager or None,
        speculate=str(spec) if spec else None,
        prefill_recipe=a.prefill_recipe,
    )
    # The engine thread holds the GIL between steps (all the time, on the CPU backend): hand it
    # over to the event loop more often than the default 5 ms, so streams and disconnects stay prompt.
    sys.setswitchinterval(0.001)
    if a.host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_key:
        print(
            f"atomflow serve: warning: listening on {a.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
            flush=True,
        )
    app = create_app(cfg)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=a.host,
            port=a.port,
            log_level=a.log_level,
            access_log=a.log_level == "debug",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=KEEP_ALIVE_S,
            limit_concurrency=1024,
            h11_max_incomplete_event_size=64 << 10,
        )
    )
    worker = app.state.worker

    def watch_load():
        worker.loaded.wait()
        if worker.load_error:
            server.should_exit = True
        else:
            eng = worker.engine
            print(
                f"atomflow serve: {name} ready on {eng.backend_name}, max_context {eng.max_context}", file=sys.stderr, flush=True
            )

    import threading

    threading.Thread(target=watch_load, daemon=True).start()
    where = f"http://{a.host}:{a.port}" if a.port else f"{a.host}, a free port (uvicorn's line below names it)"
    print(f"atomflow serve: {where} (loading {a.model})", file=sys.stderr, flush=True)
    server.run()
    if worker.load_error:
        raise RuntimeError(worker.load_error)
    return 0
