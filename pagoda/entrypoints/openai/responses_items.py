"""`ResponseItems`: a response's output items, and the Responses stream events that build them.

The answer's text goes into one message item, opened at its first text; its function calls
follow as `function_call` items once the answer is whole (a call is whole only then for a
forced choice, and this way the items' order never depends on how the text arrived). A plain
answer and a stream build their items through the same calls, so the stream's last event
carries the very object a request without streaming gets: [message] + calls, or the calls
alone, or one (maybe empty) message when there are neither.
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
    OutputText,
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

    def text(self, piece: str) -> list[ResponseEvent]:
        """More of the answer's text (the message item opens with the first piece)."""
        events = self._open_message() if self._message_index is None else []
        self._text.append(piece)
        events.append(TextDeltaEvent(sequence_number=next(self.numbers), delta=piece, **self._message_ids()))
        return events

    def finish(self, calls: tuple[ParsedToolCall, ...], status: str) -> list[ResponseEvent]:
        """The answer is whole: the message is done (status "completed" or "incomplete"), then its calls."""
        events = self._open_message() if self._message_index is None and not calls else []
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
