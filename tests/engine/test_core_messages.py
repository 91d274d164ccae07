"""A `CoreReport` survives pickling whole: outputs that carry only new tokens travel as columns
(`pack_outputs`), every other output as itself, and all come back in their order."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from pagoda.engine.core_messages import CoreReport, pack_outputs, unpack_outputs
from pagoda.outputs import EngineCoreOutput, FinishReason, LogprobsArrays, SchedulerStats


def _logprobs() -> LogprobsArrays:
    return LogprobsArrays(
        token_ids=np.array([[5, 6]], dtype=np.int64),
        logprobs=np.array([[-0.1, -2.0]], dtype=np.float32),
        ranks=np.array([1], dtype=np.int64),
    )


def test_every_field_but_the_tokens_marks_an_output_to_send_whole() -> None:
    """pack_outputs tests these fields by name: a new field must join that test, or plain
    outputs would lose it on the way."""
    names = {f.name for f in dataclasses.fields(EngineCoreOutput)}
    assert names == {
        "req_id",
        "new_token_ids",
        "finish_reason",
        "stop_reason",
        "error",
        "new_logprobs",
        "new_prompt_logprobs",
        "pooling_output",
        "kv_transfer_params",
    }
    for name, value in [
        ("finish_reason", FinishReason.LENGTH),
        ("stop_reason", "###"),
        ("error", "refused"),
        ("new_logprobs", _logprobs()),
        ("new_prompt_logprobs", _logprobs()),
        ("pooling_output", np.ones(3, dtype=np.float32)),
        ("kv_transfer_params", {"remote": "handle"}),
    ]:
        output = EngineCoreOutput("r", [1], **{name: value})
        assert pack_outputs([output])[3] == [(0, output)], name


def test_a_mixed_step_round_trips_in_order() -> None:
    outputs = [
        EngineCoreOutput("finished-first", [9], finish_reason=FinishReason.STOP, stop_reason=2),
        EngineCoreOutput("a", [1]),
        EngineCoreOutput("speculated", [2, 3, 4]),
        EngineCoreOutput("refused", [], FinishReason.ERROR, error="too long"),
        EngineCoreOutput("no-new-tokens", []),
        EngineCoreOutput("b", [2**40]),
        EngineCoreOutput("last-finished", [7], finish_reason=FinishReason.LENGTH),
    ]
    request_ids, counts, tokens, whole = pack_outputs(outputs)
    assert request_ids == ["a", "speculated", "no-new-tokens", "b"]
    assert list(counts) == [1, 3, 0, 1] and list(tokens) == [1, 2, 3, 4, 2**40]
    assert [position for position, _ in whole] == [0, 3, 6]
    assert unpack_outputs(pack_outputs(outputs)) == outputs


def test_a_report_pickles_with_packed_outputs_and_comes_back_equal() -> None:
    outputs = [EngineCoreOutput(f"req-{i}", [100 + i]) for i in range(64)]
    outputs[10] = EngineCoreOutput("req-10", [110], new_logprobs=_logprobs())
    report = CoreReport(
        outputs=outputs,
        stats=SchedulerStats(64, 0, 0.5, 10, 5, 0),
        num_commands_applied=3,
        has_work=True,
        num_steps=7,
        idle_checks={2: None},
    )
    data = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
    unpacked = pickle.loads(data)
    assert unpacked.stats == report.stats and unpacked.num_steps == 7 and unpacked.idle_checks == {2: None}
    assert [(o.req_id, o.new_token_ids) for o in unpacked.outputs] == [(o.req_id, o.new_token_ids) for o in outputs]
    assert unpacked.outputs[10].new_logprobs is not None
    assert report.outputs is outputs  # pickling left the sender's report as it was
    # One column of tokens instead of an object per output: well under the objects' bytes.
    assert len(data) < 0.75 * len(pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL))
