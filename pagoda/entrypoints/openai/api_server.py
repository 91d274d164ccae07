"""The OpenAI-compatible HTTP server: routes, API-key check, health, metrics; `run_server`
starts the engine core process, then uvicorn, and stops the core when the server stops.

Auth: with an API key set, every route but those in OPEN_PATHS needs `Authorization: Bearer KEY`,
including any route added later (the check is by path, before routing). Open: `/health`, and
the browser's static pages (the chat page `/`, `/docs`, `/redoc`, their assets, `/openapi.json`:
ui_routes.py says why). `/metrics` is guarded too: it tells traffic volume
and load to whoever reads it, and Prometheus scrape configs send bearer tokens
(`authorization: {credentials: KEY}`).

Sleep mode (`--enable-sleep-mode`): `POST /sleep?level=1|2` releases the weights (level 1 keeps
a CPU copy, level 2 reloads them from the checkpoint) and the KV cache; `POST /wake_up`, with
optional `?tags=weights&tags=kv_cache`, restores them; `GET /is_sleeping`. While asleep, requests
get 503 `engine_sleeping` and /health stays 200 with `"sleeping": true`. `POST /update_weights`
`{"path": ...}` loads new weights in place, only with `--enable-weight-updates` (403 otherwise:
it reads any path the server can). LoRA adapters (serving_lora.py): `--lora-modules name=path`,
`model=<adapter name>`, and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` with
`--enable-lora-updates` only (403 otherwise, for the same reason). A sleep with requests in flight gets 409, as does any call
the engine's state forbids (waking what is awake); a bad argument gets 400 naming it.

Stopping: SIGTERM (or SIGINT) makes the server drain: new requests get 503, the listening
socket closes, requests in flight run to their end for up to `--shutdown-timeout` seconds
(then they are cancelled), the engine core stops, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda import __version__
from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.core_client import EngineCoreClient, EngineDeadError
from pagoda.entrypoints.openai.cli_args import ServerOptions
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    engine_control_error,
    install_absent_routes,
    install_error_handlers,
)
from pagoda.entrypoints.openai.http_server import DrainingServer, uvicorn_config
from pagoda.entrypoints.openai.limits import request_limits
from pagoda.entrypoints.openai.middleware import BodySizeLimitMiddleware, DrainingMiddleware
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UpdateWeightsRequest,
)
from pagoda.entrypoints.openai.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from pagoda.entrypoints.openai.protocol_responses import DeletedResponse, ResponseObject, ResponsesRequest
from pagoda.entrypoints.openai.request_body import (
    Body,
    body_schema,
    count_ignored_fields,
    install_body_schemas,
    parse_body,
)
from pagoda.entrypoints.openai.response_store import ResponseStore
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagoda.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagoda.entrypoints.openai.serving_lora import LoadLoRAAdapterRequest, OpenAIServingLoRA, UnloadLoRAAdapterRequest
from pagoda.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagoda.entrypoints.openai.serving_score import OpenAIServingRerank, OpenAIServingScore
from pagoda.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagoda.entrypoints.openai.ui_routes import OPEN_PATHS as UI_OPEN_PATHS
from pagoda.entrypoints.openai.ui_routes import add_ui_routes
from pagoda.metrics import CONTENT_TYPE
from pagoda.multimodal.processing import is_multimodal
from pagoda.process_exit import freeze_startup_objects
from pagoda.worker.worker import SLEEP_TAGS

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"}) | UI_OPEN_PATHS
# Seconds a server whose engine core died keeps answering (errors, /health 503) before it exits.
ENGINE_DEAD_EXIT_DELAY_S = 2.0
SLEEP_LEVELS = ("1", "2")


class APIKeyMiddleware:
    """Refuses requests without the right bearer token before anything reads their body
    (plain ASGI, so streaming and disconnect handling pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing API key" if not given else "invalid API key"
                error = OpenAIError(
                    401, f"{message}: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def served_name(config: EngineConfig) -> str:
    """The model's name for clients: its file or folder name, without `.gguf`."""
    name = os.path.basename(os.path.normpath(config.model_config.model))
    return name.removesuffix(".gguf")


async def exit_when_engine_dies(engine: AsyncLLM) -> None:
    """A dead engine core never recovers: once its requests have had their errors (and /health
    its 503s) for ENGINE_DEAD_EXIT_DELAY_S, end the server with exit code 1, so a supervisor
    sees the failure and restarts it. The core process is reaped first: none is left behind."""
    engine.start()  # watch the core from the start, not from the first request
    await engine.died.wait()
    await asyncio.sleep(ENGINE_DEAD_EXIT_DELAY_S)
    logger.error("the engine core died (%s): the server exits with code 1", engine.dead_error)
    engine.client.shutdown()
    logging.shutdown()
    os._exit(1)


def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    options: ServerOptions | None = None,
) -> FastAPI:
    options = options if options is not None else ServerOptions()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watchdog = asyncio.get_running_loop().create_task(exit_when_engine_dies(engine), name="pagoda-watchdog")
        await asyncio.to_thread(lambda: engine.engine.token_bytes)  # a pass over the vocabulary, before serving
        yield
        watchdog.cancel()
        await engine.shutdown()

    app = FastAPI(title="Pagoda", lifespan=lifespan, docs_url=None, redoc_url=None)  # ui_routes serves them
    app.state.draining = False
    install_error_handlers(app)
    add_ui_routes(app, options.enable_ui)
    # The last added runs first: drain check, then the key, then the body limit.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=options.max_request_body_bytes)
    if options.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key)
    app.add_middleware(DrainingMiddleware, state=app.state)
    completions = OpenAIServingCompletion(engine, served_model_name)
    chat = OpenAIServingChat(
        engine,
        served_model_name,
        options.trust_request_chat_template,
        options.tool_call_parser,
        options.reasoning_parser,
    )
    responses = OpenAIServingResponses(engine, served_model_name, ResponseStore(), chat)
    tokenization = OpenAIServingTokenization(engine, served_model_name, options.trust_request_chat_template)
    embeddings = OpenAIServingEmbedding(engine, served_model_name)
    scores = OpenAIServingScore(engine, served_model_name)
    rerank = OpenAIServingRerank(engine, served_model_name)
    # One registry of LoRA adapters for every route that reads `model`.
    lora = OpenAIServingLoRA(engine, served_model_name)
    for serving in (completions, chat, responses, tokenization, embeddings, scores, rerank):
        serving.lora = lora
    for name, path in options.lora_modules:
        lora.register(name, path)
    max_model_len = engine.config.model_config.max_model_len
    limits = request_limits(engine.tokenizer, max_model_len)
    if is_multimodal(engine.config.model_config.hf_config):
        limits = dataclasses.replace(limits, accepts_images=True)
        processor = engine.engine.processor
        processor.media_limits = dataclasses.replace(
            processor.media_limits, allowed_domains=frozenset(options.allowed_media_domains)
        )
    install_body_schemas(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            TokenizeRequest,
            DetokenizeRequest,
            UpdateWeightsRequest,
            EmbeddingRequest,
            ScoreRequest,
            RerankRequest,
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        ],
    )
    install_absent_routes(app)

    async def read_body(raw_request: Request, model: type[Body]) -> Body:
        """The body as `model`, unknown top-level fields ignored unless --strict-request-fields."""
        return await parse_body(raw_request, model, limits, served_model_name, options.strict_request_fields)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine core lives and makes progress (a step within the stall limit
        whenever it has work); 503 saying why otherwise."""
        try:
            engine.check_health()
        except EngineDeadError as error:
            return OpenAIError(503, f"unhealthy: {str(error).splitlines()[0]}").response()
        return JSONResponse({"status": "ok", "sleeping": engine.sleeping, "engine_steps": engine.client.num_core_steps})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=lora.model_cards(max_model_len))

    def check_lora_updates() -> None:
        """Refused whatever the body says while the feature is off: its fields mean nothing then."""
        if not options.enable_lora_updates:
            raise OpenAIError(403, "LoRA updates are off: start the server with --enable-lora-updates")

    @app.post("/v1/load_lora_adapter", openapi_extra=body_schema(LoadLoRAAdapterRequest))
    async def load_lora_adapter(raw_request: Request) -> dict[str, Any]:
        """Serve the adapter at `lora_path` as `lora_name` (with --enable-lora-updates only)."""
        check_lora_updates()
        body = await read_body(raw_request, LoadLoRAAdapterRequest)
        adapter = await lora.load(body.lora_name, body.lora_path)
        return {"lora_name": adapter.lora_name, "lora_int_id": adapter.lora_int_id}

    @app.post("/v1/unload_lora_adapter", openapi_extra=body_schema(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(raw_request: Request) -> dict[str, Any]:
        check_lora_updates()
        body = await read_body(raw_request, UnloadLoRAAdapterRequest)
        adapter = lora.unload(body.lora_name)
        return {"lora_name": adapter.lora_name, "lora_int_id": adapter.lora_int_id}

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def create_completion(raw_request: Request) -> Response:
        body = await read_body(raw_request, CompletionRequest)
        return count_ignored_fields(await completions.create(body, raw_request), body)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def create_chat_completion(raw_request: Request) -> Response:
        body = await read_body(raw_request, ChatCompletionRequest)
        return count_ignored_fields(await chat.create(body, raw_request), body)

    @app.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def create_response(raw_request: Request) -> Response:
        body = await read_body(raw_request, ResponsesRequest)
        return count_ignored_fields(await responses.create(body, raw_request), body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> ResponseObject:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> DeletedResponse:
        return responses.delete(response_id)

    @app.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingRequest))
    async def create_embedding(raw_request: Request) -> Response:
        body = await read_body(raw_request, EmbeddingRequest)
        return count_ignored_fields(await embeddings.create(body, raw_request), body)

    @app.post("/v1/score", openapi_extra=body_schema(ScoreRequest))
    async def create_score(raw_request: Request) -> Response:
        body = await read_body(raw_request, ScoreRequest)
        return count_ignored_fields(await scores.create(body, raw_request), body)

    for rerank_path in ("/rerank", "/v1/rerank"):

        @app.post(rerank_path, openapi_extra=body_schema(RerankRequest))
        async def create_rerank(raw_request: Request) -> Response:
            body = await read_body(raw_request, RerankRequest)
            return count_ignored_fields(await rerank.create(body, raw_request), body)

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest), response_model=TokenizeResponse)
    async def tokenize(raw_request: Request) -> Response:
        body = await read_body(raw_request, TokenizeRequest)
        return count_ignored_fields(JSONResponse((await tokenization.tokenize(body)).model_dump()), body)

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest), response_model=DetokenizeResponse)
    async def detokenize(raw_request: Request) -> Response:
        body = await read_body(raw_request, DetokenizeRequest)
        return count_ignored_fields(JSONResponse((await tokenization.detokenize(body)).model_dump()), body)

    @app.post("/sleep")
    async def sleep(level: str = "1") -> dict[str, Any]:
        """Release the weights and the KV cache; requests get 503 until /wake_up."""
        if level not in SLEEP_LEVELS:
            raise OpenAIError(400, f"level must be 1 or 2, got {level!r}", param="level")
        if not engine.config.cache_config.enable_sleep_mode:
            raise OpenAIError(403, "sleep mode is off: start the server with --enable-sleep-mode")
        try:
            await engine.sleep(int(level))
        except Exception as error:
            raise engine_control_error(error) from error
        return {"is_sleeping": True}

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
        """Restore what `?tags=` names (weights, kv_cache; none: both)."""
        unknown = sorted(set(tags or ()) - set(SLEEP_TAGS))
        if unknown:
            raise OpenAIError(400, f"tags must be among {list(SLEEP_TAGS)}, got {unknown}", param="tags")
        try:
            await engine.wake_up(tags)
        except Exception as error:
            raise engine_control_error(error) from error
        return {"is_sleeping": engine.sleeping}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": await engine.is_sleeping()}

    @app.post("/update_weights", openapi_extra=body_schema(UpdateWeightsRequest))
    async def update_weights(raw_request: Request) -> dict[str, Any]:
        """Load the checkpoint at `path` in place (with --enable-weight-updates only)."""
        body = await read_body(raw_request, UpdateWeightsRequest)
        if not options.enable_weight_updates:
            raise OpenAIError(403, "weight updates are off: start the server with --enable-weight-updates")
        try:
            await engine.update_weights(body.path)
        except Exception as error:
            raise engine_control_error(error) from error
        return {"path": body.path}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    if options.enable_debug_routes:

        @app.get("/debug/idle")
        async def idle() -> dict[str, Any]:
            """Whether no request state is left anywhere and the KV pool is whole (for tests)."""
            detail = await engine.check_idle()
            return {"idle": detail is None, "detail": detail}

    return app


def startup_banner(engine: AsyncLLM, name: str, host: str, port: int) -> str:
    """The one line that says the server is up: where, what, and how much it holds."""
    config = engine.config
    kv_tokens = engine.client.num_kv_blocks * config.cache_config.block_size
    return (
        f"pagoda {__version__} serving {name} on http://{host}:{port} "
        f"(context {config.model_config.max_model_len:,} tokens, KV cache {kv_tokens:,} tokens)"
    )


def run_server(args: argparse.Namespace, config: EngineConfig, client: EngineCoreClient) -> int:
    """Serve with the core `client` started from `config` (see `run_serve` in the CLI): this
    process builds the tokenizer and the app while the core loads."""
    try:
        engine = AsyncLLM(config, client=client)
    except BaseException:
        client.shutdown()
        raise
    try:
        name = args.served_model_name or served_name(engine.config)
        app = build_app(engine, name, ServerOptions.from_args(args))
        logger.info(startup_banner(engine, name, args.host, args.port))
        server = DrainingServer(uvicorn_config(app, args), app)
        freeze_startup_objects()
        server.run()
    finally:
        engine.client.shutdown()  # uvicorn's lifespan did it already unless the server failed to start
    return 0 if server.started else 1
