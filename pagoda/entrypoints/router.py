"""`pagoda router`: the proxy in front of a disaggregated-prefill pair of servers.

Each completion or chat request goes first to the producer (`pagoda serve --kv-role producer`)
as a prefill: one token, no stream, `kv_transfer_params: {"do_remote_decode": true}`. The
producer's answer carries the handle of the KV it now holds; the original request goes to the
consumer (`--kv-role consumer`) with that handle as its `kv_transfer_params`, and the
consumer's answer, streamed or not, is the client's. A producer answer without a handle (a
prompt shorter than one block) sends the request on without one: the consumer computes it.
Either server's refusal comes back with its status and body (an OpenAI error naming the field);
a server that cannot be reached is a 502 naming it. The client's Authorization header goes to
both servers. `/health` is healthy when both are; `/v1/models` is the consumer's.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagoda.entrypoints.openai.errors import OpenAIError

ROUTES = ("/v1/completions", "/v1/chat/completions")
# Request fields that the prefill request drops: they would ask for more than its one token.
_DECODE_ONLY_FIELDS = ("stream_options", "max_completion_tokens", "min_tokens", "best_of", "n", "stop")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's request: the client's, for one token, unstreamed, holding its KV."""
    prefill = {key: value for key, value in body.items() if key not in _DECODE_ONLY_FIELDS}
    prefill.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return prefill


class DisaggRouter:
    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    @staticmethod
    def _headers(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def _send(self, base: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        request = self.client.build_request("POST", base + path, json=body, headers=headers)
        try:
            return await self.client.send(request, stream=bool(body.get("stream")))
        except httpx.HTTPError as error:
            role = "prefill (producer)" if base == self.prefill_url else "decode (consumer)"
            raise OpenAIError(502, f"the {role} server at {base} did not answer: {error!r}") from error

    async def forward(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as error:
            raise OpenAIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from error
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        headers = self._headers(request)
        prefill = await self._send(self.prefill_url, path, prefill_body(body), headers)
        if prefill.status_code != 200:
            return _passthrough(prefill)
        handle = prefill.json().get("kv_transfer_params")
        decode_body = {**body, "kv_transfer_params": handle}
        decode = await self._send(self.decode_url, path, decode_body, headers)
        if not decode_body.get("stream") or decode.status_code != 200:
            await decode.aread()
            return _passthrough(decode)
        return StreamingResponse(
            decode.aiter_raw(),
            status_code=decode.status_code,
            media_type=decode.headers.get("content-type", "text/event-stream"),
            background=BackgroundTask(decode.aclose),
        )

    async def health(self) -> Response:
        down = []
        for role, base in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                if (await self.client.get(base + "/health")).status_code != 200:
                    down.append(f"{role} ({base})")
            except httpx.HTTPError:
                down.append(f"{role} ({base}) unreachable")
        if down:
            return JSONResponse({"status": "unhealthy", "down": down}, status_code=503)
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        try:
            answer = await self.client.get(self.decode_url + "/v1/models", headers=self._headers(request))
        except httpx.HTTPError as error:
            raise OpenAIError(
                502, f"the decode (consumer) server at {self.decode_url} did not answer: {error!r}"
            ) from error
        return _passthrough(answer)


def _passthrough(answer: httpx.Response) -> Response:
    return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))


def build_router_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    router = DisaggRouter(prefill_url, decode_url, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await router.client.aclose()

    app = FastAPI(title="pagoda router", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, error: OpenAIError) -> Response:
        return error.response()

    for path in ROUTES:

        async def route(request: Request, path: str = path) -> Response:
            return await router.forward(path, request)

        app.add_api_route(path, route, methods=["POST"])
    app.add_api_route("/health", router.health, methods=["GET"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])

    return app


def run_router(args: argparse.Namespace) -> int:
    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            print(f"pagoda router: error: --{name} must be an http(s) URL, got {url!r}", file=sys.stderr)
            return 2
    if not 1 <= args.port <= 65535:
        print(f"pagoda router: error: --port must be in 1-65535, got {args.port}")
        return 2
    app = build_router_app(args.prefill, args.decode, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
