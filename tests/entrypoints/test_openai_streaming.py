"""The streaming plumbing the server's endpoints share, without a server: stop-string hold-back
and merging the outputs of several prompts (closing the merge closes every stream)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("fastapi")

from pagoda.entrypoints.openai.streaming import ChoiceTracker, merge_outputs, pending_stop_prefix
from pagoda.outputs import CompletionOutput, RequestOutput


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [
        ("Hello", ["END"], 0),
        ("Hello E", ["END"], 1),
        ("Hello EN", ["END"], 2),
        ("Hello EN", ["NX", "END"], 2),
        ("Hello N", ["NX", "END"], 1),
        ("xaba", ["ab", "abac"], 3),  # the longest start that fits, not the first found
        ("E", ["END"], 1),
        ("", ["END"], 0),
        ("Hello", [], 0),
    ],
)
def test_pending_stop_prefix(text: str, stops: list[str], held: int) -> None:
    assert pending_stop_prefix(text, stops) == held


def completion(text: str, num_tokens: int, finish_reason: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=list(range(num_tokens)), finish_reason=finish_reason)


def test_tracker_holds_back_a_possible_stop_string_until_decided() -> None:
    tracker = ChoiceTracker(["END"])
    first = tracker.update(completion("Hello E", 2))
    assert first.text == "Hello " and first.token_ids == [0, 1]
    second = tracker.update(completion("Hello EN", 3))
    assert second.text == "" and second.token_ids == [2], "new tokens go out, the text waits"
    # The stop string completed: the engine truncated the text before it.
    last = tracker.update(completion("Hello ", 4, "stop"))
    assert last.text == "" and last.finish_reason == "stop"
    assert tracker.update(completion("Hello ", 4, "stop")) is None, "nothing after the last delta"


def test_tracker_releases_text_that_was_not_a_stop_string() -> None:
    tracker = ChoiceTracker(["END"])
    sent = tracker.update(completion("Hello E", 2)).text
    sent += tracker.update(completion("Hello Every", 3)).text
    sent += tracker.update(completion("Hello Every day", 4, "length")).text
    assert sent == "Hello Every day"


def test_tracker_sends_nothing_when_nothing_is_new() -> None:
    tracker = ChoiceTracker([])
    assert tracker.update(completion("Hi", 1)).text == "Hi"
    assert tracker.update(completion("Hi", 1)) is None


def output(request_id: str, text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, None, [1], [completion(text, len(text))], finished=finished)


def test_merge_outputs_interleaves_and_closes_every_stream() -> None:
    closed: list[str] = []

    async def stream(name: str, count: int, delay: float) -> AsyncIterator[RequestOutput]:
        try:
            for i in range(count):
                await asyncio.sleep(delay)
                yield output(name, name * (i + 1), finished=i == count - 1)
        finally:
            closed.append(name)

    async def run_all() -> list[tuple[int, str]]:
        return [(p, o.outputs[0].text) async for p, o in merge_outputs([stream("a", 3, 0.01), stream("b", 2, 0.015)])]

    merged = asyncio.run(run_all())
    assert [text for position, text in merged if position == 0] == ["a", "aa", "aaa"]
    assert [text for position, text in merged if position == 1] == ["b", "bb"]
    assert sorted(closed) == ["a", "b"]

    closed.clear()

    async def leave_early() -> None:
        merged = merge_outputs([stream("a", 100, 0.01), stream("b", 100, 0.01)])
        async for _ in merged:
            break
        await merged.aclose()

    asyncio.run(leave_early())
    assert sorted(closed) == ["a", "b"], "a client that leaves early ends every request"
