"""`ResponseItems`: a response's output items, and the Responses stream events that build them.

With a reasoning parser, the reasoning comes first as one `reasoning` item (its text a
`reasoning_text` part, streamed as `response.reasoning_text.delta` events), closed when the
answer begins or the output ends. The answer's text goes into one message item, opened at its
first text; its function calls follow as `function_call` items once the answer is whole (a call is whole only then for a
forced choice, and this way the items' order never depends on how the text arrived). A plain
answer and a stream build their items through the same calls, so the stream's last event
carries the very object a request without streaming gets: [reasoning] + [message] + calls,
or the calls alone, or one (maybe empty) message when there are neither.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

from pagoda.entrypoints.openai.protocol_responses import (
    ContentPartEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall
from pagoda.entrypoints.openai.tools import call_id


class ResponseItems:
    def __init__(self, message_id: str, numbers: Iterator[int]) -> None:
        self.message_id = message_id
        self.numbers = numbers  # the stream's sequence numbers
        self.items: list[OutputItem] = []
        self._message_index: int | None = None
        self._text: list[str] = []
        self.reasoning_id = f"rs_{secrets.token_hex(12)}"
        self._reasoning_index: int | None = None
        self._reasoning: list[str] | None = None  # None once the reasoning item is done

    def reasoning(self, piece: str) -> list[ResponseEvent]:
        """More of the reasoning (its item opens with the first piece, before any answer)."""
        assert self._message_index is None and not self._reasoning_closed, "the reasoning comes first"
        events = self._open_reasoning() if self._reasoning_index is None else []
        assert self._reasoning is not None
        self._reasoning.append(piece)
        events.append(ReasoningTextDeltaEvent(sequence_number=next(self.numbers), delta=piece, **self._reasoning_ids()))
        return events

    def text(self, piece: str) -> list[ResponseEvent]:
        """More of the answer's text (the message item opens with the first piece, after the
        reasoning item is done)."""
        events = self._close_reasoning("completed")
        if self._message_index is None:
            events += self._open_message()
        self._text.append(piece)
        events.append(TextDeltaEvent(sequence_number=next(self.numbers), delta=piece, **self._message_ids()))
        return events

    def finish(self, calls: tuple[ParsedToolCall, ...], status: str) -> list[ResponseEvent]:
        """The answer is whole: the reasoning and the message are done (status "completed" or
        "incomplete"), then its calls."""
        events = self._close_reasoning(status)
        if self._message_index is None and not calls:
            events += self._open_message()
        if self._message_index is not None:
            text = "".join(self._text)
            part = OutputText(text=text)
            message = OutputMessage(id=self.message_id, status=status, content=[part])
            self.items[self._message_index] = message
            ids = self._message_ids()
            events += [
                TextDoneEvent(sequence_number=next(self.numbers), text=text, **ids),
                ContentPartEvent(
                    type="response.content_part.done", sequence_number=next(self.numbers), part=part, **ids
                ),
                self._item_event("response.output_item.done", self._message_index, message),
            ]
        for call in calls:
            events += self._call(call)
        return events

    @property
    def _reasoning_closed(self) -> bool:
        return self._reasoning_index is not None and self._reasoning is None

    def _open_reasoning(self) -> list[ResponseEvent]:
        self._reasoning_index = len(self.items)
        self._reasoning = []
        item = OutputReasoning(id=self.reasoning_id, status="in_progress", content=[])
        self.items.append(item)
        return [
            self._item_event("response.output_item.added", self._reasoning_index, item),
            ContentPartEvent(
                type="response.content_part.added",
                sequence_number=next(self.numbers),
                part=ReasoningText(text=""),
                **self._reasoning_ids(),
            ),
        ]

    def _close_reasoning(self, status: str) -> list[ResponseEvent]:
        """The reasoning item's last events, once (nothing when it never opened)."""
        if self._reasoning is None or self._reasoning_index is None:
            return []
        text = "".join(self._reasoning)
        self._reasoning = None
        part = ReasoningText(text=text)
        item = OutputReasoning(id=self.reasoning_id, status=status, content=[part])
        self.items[self._reasoning_index] = item
        ids = self._reasoning_ids()
        return [
            ReasoningTextDoneEvent(sequence_number=next(self.numbers), text=text, **ids),
            ContentPartEvent(type="response.content_part.done", sequence_number=next(self.numbers), part=part, **ids),
            self._item_event("response.output_item.done", self._reasoning_index, item),
        ]

    def _reasoning_ids(self) -> dict[str, str | int]:
        assert self._reasoning_index is not None
        return {"item_id": self.reasoning_id, "output_index": self._reasoning_index, "content_index": 0}

    def _open_message(self) -> list[ResponseEvent]:
        self._message_index = len(self.items)
        message = OutputMessage(id=self.message_id, status="in_progress", content=[])
        self.items.append(message)
        part = OutputText(text="")
        return [
            self._item_event("response.output_item.added", self._message_index, message),
            ContentPartEvent(
                type="response.content_part.added", sequence_number=next(self.numbers), part=part, **self._message_ids()
            ),
        ]

    def _message_ids(self) -> dict[str, str | int]:
        assert self._message_index is not None
        return {"item_id": self.message_id, "output_index": self._message_index, "content_index": 0}

    def _call(self, call: ParsedToolCall) -> list[ResponseEvent]:
        index = len(self.items)
        fields = {"id": f"fc_{secrets.token_hex(12)}", "call_id": call_id(), "name": call.name}
        added = OutputFunctionCall(arguments="", status="in_progress", **fields)
        done = OutputFunctionCall(arguments=call.arguments, status="completed", **fields)
        self.items.append(done)
        ids = {"item_id": done.id, "output_index": index}
        return [
            self._item_event("response.output_item.added", index, added),
            FunctionCallArgumentsDeltaEvent(sequence_number=next(self.numbers), delta=call.arguments, **ids),
            FunctionCallArgumentsDoneEvent(sequence_number=next(self.numbers), arguments=call.arguments, **ids),
            self._item_event("response.output_item.done", index, done),
        ]

    def _item_event(self, kind: str, index: int, item: OutputItem) -> OutputItemEvent:
        return OutputItemEvent(type=kind, sequence_number=next(self.numbers), output_index=index, item=item)
