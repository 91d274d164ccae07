"""RequestOutputKind in the output processor: FINAL_ONLY requests (what LLM.generate asks for)
yield only their finished output, a parent of parallel samples only once every sample ended;
CUMULATIVE ones one output per step with everything so far."""

from __future__ import annotations

import pytest

from pagoda.engine.core_request import EngineCoreRequest
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.parallel_sampling import ParentRequest
from pagoda.errors import InvalidRequestError
from pagoda.outputs import EngineCoreOutput, FinishReason
from pagoda.sampling_params import RequestOutputKind, SamplingParams

FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def test_final_only_yields_the_finished_output_alone_and_cumulative_every_step() -> None:
    processor = OutputProcessor(tokenizer=None)
    processor.add_request("final", None, [1, 2], SamplingParams(max_tokens=3, output_kind=FINAL_ONLY))
    processor.add_request("cumulative", None, [1, 2], SamplingParams(max_tokens=3))
    for step, token in enumerate([5, 6, 7]):
        finish = FinishReason.LENGTH if step == 2 else None
        outputs = processor.process_outputs(
            [EngineCoreOutput("final", [token], finish), EngineCoreOutput("cumulative", [token], finish)]
        ).outputs
        by_id = {output.request_id: output for output in outputs}
        assert by_id["cumulative"].outputs[0].token_ids == [5, 6, 7][: step + 1]
        assert ("final" in by_id) == (step == 2)
    assert by_id["final"].finished and by_id["final"].outputs[0].token_ids == [5, 6, 7]
    assert by_id["final"].outputs[0].finish_reason == "length"
    processor.check_idle()


def test_final_only_parent_yields_once_every_sample_ended() -> None:
    params = SamplingParams(n=2, seed=1, max_tokens=2, output_kind=FINAL_ONLY)
    parent = ParentRequest(EngineCoreRequest("p", (1, 2, 3), params, frozenset()), None, share_prompt_blocks=False)
    processor = OutputProcessor(tokenizer=None)
    processor.add_parent_request(parent)
    first, second = parent.child_ids
    assert processor.process_outputs([EngineCoreOutput(first, [4]), EngineCoreOutput(second, [8])]).outputs == []
    # One sample ends, the other goes on: still nothing for the parent.
    assert processor.process_outputs([EngineCoreOutput(first, [5], FinishReason.LENGTH)]).outputs == []
    (output,) = processor.process_outputs([EngineCoreOutput(second, [9], FinishReason.LENGTH)]).outputs
    assert output.request_id == "p" and output.finished
    assert [c.token_ids for c in output.outputs] == [[4, 5], [8, 9]]
    processor.check_idle()


def test_aborting_a_final_only_request_returns_its_output() -> None:
    processor = OutputProcessor(tokenizer=None)
    processor.add_request("r", None, [1], SamplingParams(max_tokens=8, output_kind=FINAL_ONLY))
    assert processor.process_outputs([EngineCoreOutput("r", [3])]).outputs == []
    (output,) = processor.abort_requests(["r"])
    assert output.finished and output.outputs[0].token_ids == [3] and output.outputs[0].finish_reason == "abort"


def test_output_kind_must_be_a_request_output_kind() -> None:
    with pytest.raises(InvalidRequestError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="final")  # type: ignore[arg-type]
