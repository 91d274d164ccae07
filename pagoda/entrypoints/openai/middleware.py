"""Plain ASGI guards in front of the routes (plain ASGI, so streams and disconnect handling
pass through untouched): refusing new work while the server drains, and bodies over the
size limit before anything parses them."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.entrypoints.openai.errors import OpenAIError


class DrainingMiddleware:
    """After a stop signal: every new request (health checks included, so load balancers look
    elsewhere) gets 503 while the ones already running finish."""

    def __init__(self, app: ASGIApp, state: object) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and getattr(self.state, "draining", False):
            error = OpenAIError(
                503, "the server is shutting down", code="shutting_down", headers={"Connection": "close"}
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a body over `max_bytes`: at once when Content-Length says so, otherwise
    as soon as the chunks read so far pass it. The body is read here and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = OpenAIError(
            413,
            f"the request body is larger than the server's limit of {self.max_bytes} bytes (--max-request-body-bytes)",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)
