"""The server's assembly: auth, request ids and the access log at the edge, the error handlers, one
router per protocol (server/protocols/: OpenAI chat and completions, embeddings, Anthropic Messages,
OpenAI Responses) and the server's own routes (models, LoRA adapters, health, metrics, caches).

The app talks to the engine only through its EngineLoop (the model thread owns the engine); request
input goes through the InputProcessor, in the input pool (server/prompts.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from foveal.config import ServerConfig
from foveal.engine.input_processor import InputProcessor
from foveal.engine.loop import EngineLoop
from foveal.metrics import FanoutSink, SummarySink
from foveal.metrics.prometheus import PrometheusSink
from foveal.request import new_request_id
from foveal.server import openapi
from foveal.server.body import ClientLeft, read_json
from foveal.server.errors import APIError, error_response
from foveal.server.inputs import InputWork
from foveal.server.prompts import Prompts
from foveal.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
)
from foveal.server.protocols import anthropic, embeddings, openai, responses, transcriptions

log = logging.getLogger(__name__)
UI = Path(__file__).with_name("ui")  # index.html, ui.js, ui.css
access_log = logging.getLogger("foveal.access")


class _Edge:
    """Pure ASGI middleware (streaming-safe): bearer auth and the X-Request-Id response header.

    Auth also names the caller's tenant (each key its own unless --api-key-file groups them) and whether
    it is an admin; the tenant becomes the prefix-cache salt, so isolation follows the key, not a value
    the client chooses. Every key is compared (constant time each), so timing says nothing about which."""

    def __init__(self, app, cfg: ServerConfig):
        self.app, self.cfg = app, cfg
        self.keys = list(cfg.api_keys)
        if cfg.api_key:
            self.keys.append((cfg.api_key, "default", True))

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1/") or (path.startswith("/metrics") and not self.cfg.metrics_public)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["request_id"] = new_request_id("req")
        t0, status = time.perf_counter(), [0]

        async def send_with_id(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                headers = [h for h in msg.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", state["request_id"].encode()))
                msg = {**msg, "headers": headers}
            await send(msg)

        state["tenant"], state["admin"] = None, not self.keys  # no auth: one tenant, everyone is admin
        if self.keys and self._protected(scope["path"]):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            # Bearer, or Anthropic's x-api-key header
            token = auth[7:].encode() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"")
            found = None
            for key, tenant, admin in self.keys:
                if hmac.compare_digest(token, key.encode()):
                    found = (tenant, admin)
            if found is None:
                resp = shaped_error(
                    scope["path"], APIError(401, "invalid or missing API key", code="invalid_api_key")
                )
                await resp(scope, receive, send_with_id)
                return self._access(scope, state, status[0], t0)
            state["tenant"], state["admin"] = found

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._access(scope, state, status[0], t0)

    @staticmethod
    def _access(scope, state, status: int, t0: float) -> None:
        """The access log, with our request id (uvicorn's own access log is off: it has none)."""
        access_log.info(
            '%s "%s %s" %d %.3fs',
            state["request_id"],
            scope["method"],
            scope["path"],
            status,
            time.perf_counter() - t0,
        )


def shaped_error(path: str, e: APIError) -> Response:
    """An error in the shape of the protocol the path belongs to: Anthropic's under /v1/messages,
    OpenAI's everywhere else."""
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic.error_body(e), status_code=e.status, headers=e.headers)
    return error_response(e)


def create_app(engine, processor: InputProcessor, cfg: ServerConfig | None = None) -> FastAPI:
    """Build the app around a started Engine (handed to the EngineLoop, which starts with the app's
    lifespan) and its InputProcessor (`engine/factory.py` builds the pair)."""
    cfg = cfg or ServerConfig()
    prom, summary = PrometheusSink(), SummarySink()
    loop = EngineLoop(engine, cfg.max_queued_requests, FanoutSink(prom, summary))
    del engine  # from here on, only through the loop
    info = processor.info
    model_name = cfg.served_model_name or info.model_name
    names = {model_name, info.model_name}
    created = int(time.time())
    inputs = InputWork(cfg.input_workers, cfg.input_timeout)
    prompts = Prompts(processor, cfg, inputs)

    @asynccontextmanager
    async def lifespan(app):
        inputs.start()
        await asyncio.to_thread(processor.prepare_grammars)
        loop.start()
        log.info("serving %s", model_name)
        yield
        await asyncio.to_thread(loop.shutdown, cfg.drain_timeout)
        inputs.shutdown()

    app = FastAPI(title="foveal", lifespan=lifespan)
    app.state.loop, app.state.prometheus, app.state.summary = loop, prom, summary
    app.state.inputs, app.state.prompts = inputs, prompts
    openapi.publish_request_bodies(
        app,
        {
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/completions": CompletionRequest,
            "/v1/load_lora_adapter": LoadLoraRequest,
            "/v1/unload_lora_adapter": UnloadLoraRequest,
            "/v1/embeddings": embeddings.EmbeddingRequest,
            "/v1/messages": anthropic.MessagesRequest,
            "/v1/messages/count_tokens": anthropic.CountTokensRequest,
            "/v1/responses": responses.CreateRequest,
            "/v1/responses/input_tokens": responses.InputTokensRequest,
        },
    )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return shaped_error(request.url.path, e)

    @app.exception_handler(ClientLeft)
    async def _client_left(request: Request, e: ClientLeft):
        log.info("%s: client left mid-body (%d bytes read)", request.state.request_id, e.received)
        return Response(status_code=e.status)  # nobody is there to read it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return shaped_error(
            request.url.path,
            APIError(
                e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind, headers=e.headers
            ),
        )

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(request: Request, e: RequestValidationError):
        """A path or query parameter of the wrong type (bodies are read by the routes themselves)."""
        err = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in err.get("loc", ()))
        return shaped_error(
            request.url.path, APIError(400, f"{where}: {err.get('msg', 'invalid')}", param=where or None)
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("%s: unhandled error", request.state.request_id)
        return shaped_error(
            request.url.path, APIError(500, f"internal error: {type(e).__name__}", "server_error")
        )

    app.include_router(openai.router(loop, processor, cfg, names, model_name, prompts))
    app.include_router(embeddings.router(loop, processor, cfg, names, model_name, prompts))
    app.include_router(anthropic.router(loop, processor, cfg, names, model_name, prompts))
    app.include_router(transcriptions.router(loop, processor, cfg, names, model_name, prompts))
    app.state.responses = stored = responses.ResponseStore()
    app.include_router(responses.router(loop, processor, cfg, names, model_name, prompts, stored))

    if cfg.ui:  # the built-in page: static files; its API calls carry the key like any client's
        app.mount("/ui", StaticFiles(directory=UI), name="ui")

        @app.get("/", include_in_schema=False)
        async def page():
            return FileResponse(UI / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/models")
    async def models():
        card = {
            "object": "model",
            "created": created,
            "owned_by": "foveal",
            "max_model_len": info.max_model_len,
            "max_tokens": cfg.max_tokens,  # a request's default and cap (--max-tokens); null: the context
        }
        data = [{"id": model_name, "root": info.model_name, "parent": None, **card}]
        if processor.lora is not None:  # adapters, with the served model as their parent (vLLM's cards)
            data += [
                {"id": name, "root": path, "parent": model_name, **card}
                for name, path in processor.lora.cards()
            ]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """vLLM's runtime adapter loading: {"lora_name", "lora_path"}; admins only when auth is on."""
        reg = lora_admin(request, "loading")
        body = await lora_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if name in names:
            raise APIError(400, f"'{name}' is the base model's name", param="lora_name")
        try:
            adapter = await asyncio.to_thread(reg.load, name, path)
        except ValueError as e:  # AdapterError included: the message names the field or file
            raise APIError(400, str(e), param="lora_path") from None
        log.info(
            "%s: LoRA adapter %r loaded from %s (rank %d)", request.state.request_id, name, path, adapter.rank
        )
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        """{"lora_name"}: new requests can no longer name it; running ones finish with it."""
        reg = lora_admin(request, "unloading")
        name = (await lora_body(request)).get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "'lora_name' must be provided.", param="lora_name")
        if not reg.unload(name):
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", "not_found_error", param="lora_name"
            )
        log.info("%s: LoRA adapter %r unloaded", request.state.request_id, name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    def lora_admin(request: Request, what: str):
        if not request.state.admin:
            raise APIError(403, f"{what} LoRA adapters needs an admin API key", "permission_error")
        if processor.lora is None:
            raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)")
        return processor.lora

    async def lora_body(request: Request) -> dict:
        data = await read_json(request, cfg.max_body_bytes, cfg.body_timeout)
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        return data

    @app.get("/health")
    async def health():
        body = {"status": loop.state}
        if loop.dead_reason:
            body["error"] = loop.dead_reason
        return JSONResponse(body, status_code=200 if loop.state == "ready" else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        if not (request.state.admin or cfg.metrics_public):  # global figures: admins (or everyone)
            raise APIError(403, "/metrics needs an admin API key (or --metrics-public)", "permission_error")
        grammar = processor.grammar_stats()
        if grammar is not None:
            prom.grammar(grammar)
        return Response(prom.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/metrics")
    async def metrics_json(request: Request):
        """Everything for an admin key (or without auth); a tenant's own requests otherwise."""
        if request.state.admin:
            out = summary.to_dict()
            grammar = processor.grammar_stats()
            if grammar is not None:
                s = out["summary"]
                s["structured"] = {**(s["structured"] or {}), "grammar_cache": dataclasses.asdict(grammar)}
            return out
        return summary.tenant_dict(request.state.tenant)

    @app.get("/v1/cache/stats")
    async def cache_stats(request: Request):
        """Prefix cache (lookups and hits in prompt tokens, cached/free blocks, evictions) and vision
        cache for an admin key (plain counters read off the model thread: a snapshot, not a
        transaction); for any other key, its own tenant's prompt and cached tokens only."""
        if request.state.admin:
            try:
                return await asyncio.wrap_future(loop.call(lambda e: e.cache_stats()))
            except RuntimeError as e:
                raise APIError(503, f"cannot read the cache: {e}", "unavailable") from None
        mine = summary.tenant_dict(request.state.tenant)["summary"]
        q, hit = mine["prompt_tokens"], mine["cached_prompt_tokens"]
        return {
            "prefix_cache": {
                "enabled": info.prefix_caching,
                "block_size": info.block_size,
                "query_tokens": q,
                "hit_tokens": hit,
                "hit_rate": hit / q if q else 0.0,
                "scope": "tenant",
            }
        }

    @app.post("/v1/cache/reset")
    async def cache_reset(request: Request):
        if not request.state.admin:
            raise APIError(403, "resetting the cache needs an admin API key", "permission_error")
        try:
            dropped = await asyncio.wrap_future(loop.call(lambda e: e.reset_prefix_cache()))
        except RuntimeError as e:
            raise APIError(503, f"cannot reset the cache: {e}", "unavailable") from None
        log.info("%s: cache reset (%d prefix blocks dropped)", request.state.request_id, dropped)
        return {"status": "ok", "prefix_blocks_dropped": dropped}

    app.add_middleware(_Edge, cfg=cfg)
    return app
