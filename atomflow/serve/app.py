"""The FastAPI app: OpenAI routes, /health, /metrics, the chat page, and the guards in front of
them (API key, body size, one error format).

Every error is {"error": {"message", "type", "param", "code"}} with its HTTP status; nothing
answers with a traceback. Requests are validated and tokenized here, then queued for the engine
thread (worker.py); a client that leaves, streaming or not, cancels its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from atomflow.sampling import SamplingParams
from atomflow.serve.metrics import Metrics
from atomflow.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, validation_error
from atomflow.serve.worker import EngineWorker, Job, Result

log = logging.getLogger("atomflow.serve")
STATIC = Path(__file__).resolve().parent / "static"


@dataclass
class ServeConfig:
    model: str  # the .atomflow file
    model_name: str  # the id clients send as "model"
    max_context: int | None = None  # KV cache length (None: the engine's default)
    backend: str = "auto"
    max_queue: int = 16  # requests that may wait while one runs
    request_timeout: float = 300.0  # seconds a request may wait in the queue (then 504)
    api_key: str | None = None  # Bearer key for /v1/* and /metrics (None: open)
    max_tokens: int = 4096  # the most tokens one request may generate
    max_body_bytes: int = 4 << 20  # request bodies past this: 413
    eager: bool | None = None
    speculate: str | None = None  # "ngram[:K]": every request decodes greedily with n-gram drafts
    prefill_recipe: str = "w8a16"  # or "w8a8": prompt chunks of 256+ rows on the FP8 recipe (atomflow/model/recipe.py)


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Guard:
    """ASGI middleware: counts requests by endpoint and status, and refuses bodies over the limit
    (413) by their Content-Length or, without one, as they stream in."""

    def __init__(self, app, metrics: Metrics, max_body: int):
        self.app, self.metrics, self.max_body = app, metrics, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = (
            path if path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/") else "other"
        )
        status = {}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        length = dict(scope.get("headers") or {}).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            e = ApiError(413, f"request body too large: the limit is {self.max_body} bytes", code="body_too_large")
            await _error_response(e)(scope, receive, counted_send)
        else:
            seen = 0

            async def limited_receive():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > self.max_body:
                        raise ApiError(413, f"request body too large: the limit is {self.max_body} bytes", code="body_too_large")
                return message

            await self.app(scope, limited_receive, counted_send)
        self.metrics.requests.labels(endpoint, str(status.get("code", 0))).inc()


def warm_up(eng) -> None:
    """One short run before the server says it is ready, so that the first request's TTFT is not
    the first call's one-time costs (template compile, first kernels, allocator pools)."""
    if eng.tokenizer.has_chat_template:
        eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = eng.tokenizer.encode("Hello there", add_special_tokens=True)[: max(1, eng.max_context - 4)]
    t = 0.0 if eng.speculate is not None else 1.0  # speculation is greedy only
    for _ in eng.generate_tokens(ids, SamplingParams(temperature=t, seed=0, max_new_tokens=4, ignore_eos=True)):
        pass
    eng.reset()


def create_app(cfg: ServeConfig, load=None) -> FastAPI:
    """load: () -> Engine (default: Engine.load(cfg.model, ...)); it runs on the engine thread."""
    metrics = Metrics()
    if load is None:

        def load():
            from atomflow.engine import Engine

            eng = Engine.load(
                cfg.model,
                backend=cfg.backend,
                max_context=cfg.max_context,
                eager=cfg.eager,
                speculate=cfg.speculate,
                prefill_recipe=cfg.prefill_recipe,
            )
            warm_up(eng)
            return eng

    worker = EngineWorker(load, cfg.max_queue, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()  # loads the model on the engine thread; /health says 503 until it is ready
        yield
        worker.stop()

    app = FastAPI(title="atomflow", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, cfg

    # -- errors: one format ---------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return _error_response(ApiError(e.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return _error_response(ApiError(500, "internal server error (see the server log)"))

    # -- guards -----------------------------------------------------------------------------------
    def check_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), cfg.api_key.encode()):
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY'" if not auth else "Incorrect API key provided",
                code="invalid_api_key",
            )

    def engine():
        if worker.load_error:
            raise ApiError(503, f"the model failed to load: {worker.load_error}", code="model_load_failed")
        if not worker.ready:
            raise ApiError(503, "the model is loading; retry shortly", code="loading", headers={"Retry-After": "1"})
        return worker.engine

    async def parse(request: Request, model_cls):
        body = await request.body()
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = model_cls.model_validate(obj)
        except ValidationError as e:
            raise validation_error(e) from None
        bad = req.unsupported()
        if bad is not None:
            raise bad
        if req.model is not None and req.model != cfg.model_name:
            raise ApiError(
                404, f"The model '{req.model}' does not exist (this server runs '{cfg.model_name}')", "model", "model_not_found"
            )
        return req

    def sampling(eng, req, n_prompt: int) -> SamplingParams:
        limit, field = req.token_limit
        room = eng.max_context - n_prompt
        if limit is not None and limit > cfg.max_tokens:
            raise ApiError(
                400, f"{field} is {limit}; this server allows at most {cfg.max_tokens} (--max-tokens)", field, "invalid_value"
            )
        if room < 1 or (limit is not None and limit > room):
            if limit is None or room < 1:
                asked, param = (
                    f"{n_prompt} tokens in the prompt and at least 1 to generate",
                    "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                )
            else:
                asked, param = f"{n_prompt + limit} tokens ({n_prompt} in the prompt, {limit} in the completion)", field
            raise ApiError(
                400,
                f"This model's maximum context length is {eng.max_context} tokens. However, you requested {asked}.",
                param,
                "context_length_exceeded",
            )
        gc = eng.model.metadata_json("generation_config", {}) or {}

        def pick(v, key, fallback):
            return v if v is not None else (gc.get(key) if gc.get(key) is not None else fallback)

        if eng.speculate is not None:  # --speculate: greedy unless asked otherwise, and then refused
            from atomflow.speculate import check_greedy

            try:
                check_greedy(eng.speculate, 0.0 if req.temperature is None else req.temperature)
            except ValueError as e:
                raise ApiError(400, str(e), "temperature", "unsupported_parameter") from None
            gc = {**gc, "temperature": 0.0}
        try:
            return SamplingParams(
                temperature=pick(req.temperature, "temperature", 1.0),
                top_p=pick(req.top_p, "top_p", 1.0),
                top_k=max(int(pick(req.top_k, "top_k", 0)), 0),
                seed=req.seed,
                max_new_tokens=limit or min(cfg.max_tokens, room),
                stop=req.stops,
                ignore_eos=req.ignore_eos,
            )
        except ValueError as e:  # a generation_config default out of range
            raise ApiError(400, str(e)) from None

    # -- running a job ------------------------------------------------------------------------------
    async def wait_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def first_event(request: Request, job: Job):
        """Waits for the job to start (or fail) while watching the client; 504 past the deadline."""
        get = asyncio.ensure_future(job.events.get())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({get, gone}, timeout=cfg.request_timeout, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                return get.result()
            if gone in done or worker.withdraw(job):
                job.cancel()
                worker.withdraw(job)
                get.cancel()
                if gone in done:
                    return None
                metrics.rejected.labels("timeout").inc()
                raise ApiError(
                    504,
                    f"the request waited {cfg.request_timeout:g} s in the queue without starting (--request-timeout)",
                    code="queue_timeout",
                )
            return await get  # it started just as the deadline passed
        finally:
            gone.cancel()

    async def run(request: Request, req, ids: list[int], params: SamplingParams, chat: bool):
        job = Job(ids, params, asyncio.get_running_loop())
        worker.submit(job)
        ev = await first_event(request, job)
        if ev is None:  # the client left while queued
            return Response(status_code=499)
        if ev[0] == "error":
            raise ev[1]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            # background: runs however the response ends, even when the client left before the
            # stream started (then the generator's own finally never runs)
            return StreamingResponse(
                stream(job, rid, created, chat, req.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                background=BackgroundTask(job.cancel),
            )
        collect = asyncio.ensure_future(collect_text(job))
        gone = asyncio.ensure_future(wait_disconnect(request))
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:
            job.cancel()
            collect.cancel()
            return Response(status_code=499)
        gone.cancel()
        text, res = collect.result()
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": res.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": res.finish_reason}
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": cfg.model_name,
                "choices": [choice],
                "usage": usage(res),
                "system_fingerprint": None,
            }
        )

    async def collect_text(job: Job) -> tuple[str, Result]:
        parts = []
        while True:
            kind, *rest = await job.events.get()
            if kind == "text":
                parts.append(rest[0])
            elif kind == "done":
                return "".join(parts), rest[0]
            elif kind == "error":
                raise rest[0]

    def usage(res: Result) -> dict:
        return {
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens},
        }

    async def stream(job: Job, rid: str, created: int, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return (
                "data: "
                + json.dumps(
                    {"id": rid, "object": obj, "created": created, "model": cfg.model_name, "choices": [choice]},
                    ensure_ascii=False,
                )
                + "\n\n"
            )

        try:
            if chat:
                yield chunk(None, first=True)
            while True:
                events = [await job.events.get()]
                while not job.events.empty():  # the client fell behind: catch up in one chunk
                    events.append(job.events.get_nowait())
                if any(e[0] == "text" for e in events):  # one chunk per token (or per catch-up)
                    yield chunk("".join(e[1] for e in events if e[0] == "text"))
                end = next((e for e in events if e[0] in ("done", "error")), None)
                if end is None:
                    continue
                if end[0] == "error":
                    yield "data: " + json.dumps(end[1].body()) + "\n\n"
                else:
                    res = end[1]
                    yield chunk(None, res.finish_reason)
                    if include_usage:
                        yield (
                            "data: "
                            + json.dumps(
                                {
                                    "id": rid,
                                    "object": obj,
                                    "created": created,
                                    "model": cfg.model_name,
                                    "choices": [],
                                    "usage": usage(res),
                                }
                            )
                            + "\n\n"
                        )
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client left (or the run is over: then this does nothing)

    # -- routes -------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        eng = engine()
        req = await parse(request, ChatCompletionRequest)
        messages = [m.as_template_message() for m in req.messages]

        def encode() -> list[int]:
            tok = eng.tokenizer
            if not tok.has_chat_template:
                raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True)
            except Exception as e:  # the template's raise_exception (e.g. roles must alternate), sandbox refusals
                raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
            return tok.encode(text, add_special_tokens=False)

        ids = await run_in_threadpool(encode)
        return await run(request, req, ids, sampling(eng, req, len(ids)), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        eng = engine()
        req = await parse(request, CompletionRequest)
        prompt = req.single_prompt
        if isinstance(prompt, str):
            ids = await run_in_threadpool(eng.tokenizer.encode, prompt, True)
        else:
            vocab = eng.spec.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} in the prompt is out of range [0, {vocab})", "prompt")
            ids = list(prompt)
        return await run(request, req, ids, sampling(eng, req, len(ids)), chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        eng = engine()
        return {
            "object": "list",
            "data": [
                {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "atomflow", "max_model_len": eng.max_context}
            ],
        }

    @app.get("/health")
    async def health():
        if worker.load_error:
            return JSONResponse({"status": "error", "message": worker.load_error}, status_code=503)
        if not worker.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        eng = worker.engine
        return {
            "status": "ok",
            "model": cfg.model_name,
            "backend": eng.backend_name,
            "max_context": eng.max_context,
            "busy": worker.busy,
            "queued": worker.queued,
        }

    @app.get("/metrics")
    async def prometheus(request: Request):
        check_key(request)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.add_middleware(Guard, metrics=metrics, max_body=cfg.max_body_bytes)
    return app
