"""Plumbing that completions and chat share: what of a choice the client has not seen yet
(holding back text that may start a stop string), merging the outputs of several prompts,
Server-Sent Events, and ending work the moment its client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.entrypoints.openai.errors import to_openai_error
from pagoda.entrypoints.openai.text_prefix import pending_stop_prefix
from pagoda.outputs import CompletionOutput, RequestOutput, SampleLogprobs

T = TypeVar("T")


@dataclass
class ChoiceDelta:
    """What one choice gained since the client last heard of it."""

    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChoiceTracker:
    """Follows one choice's cumulative outputs. Text that could be the start of a stop string
    is held back until the next tokens decide it, so a stop string never leaks in part."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.num_chars_sent = 0
        self.num_tokens_sent = 0
        self.finished = False

    def update(self, completion: CompletionOutput) -> ChoiceDelta | None:
        if self.finished:
            return None
        text = completion.text
        end = len(text) if completion.finished else len(text) - pending_stop_prefix(text, self.stops)
        end = max(end, self.num_chars_sent)
        token_ids = completion.token_ids[self.num_tokens_sent :]
        if end == self.num_chars_sent and not token_ids and not completion.finished:
            return None
        logprobs = completion.logprobs[self.num_tokens_sent :] if completion.logprobs is not None else None
        delta = ChoiceDelta(
            text=text[self.num_chars_sent : end],
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        self.num_chars_sent = end
        self.num_tokens_sent = len(completion.token_ids)
        self.finished = completion.finished
        return delta


async def merge_outputs(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position. Closing
    this closes every stream (aborting requests not finished)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(position: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((position, output))
            queue.put_nowait(None)
        except Exception as error:
            queue.put_nowait(error)

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """`data: {json}` events ending with `data: [DONE]`; an error after the stream began is
    sent as an OpenAI error event, since the status line has gone out already."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
    except Exception as error:
        yield f"data: {json.dumps(to_openai_error(error).body())}\n\n"
    yield "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that ends the moment the client disconnects, whatever the server's ASGI
    version: the body is closed at once and `on_close` runs (it aborts the requests, so their
    KV blocks return to the pool)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop_listening() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop_listening)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            self.on_close()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` unless the client disconnects first; then cancel it (aborting its requests)
    and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()
