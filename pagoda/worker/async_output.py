"""`AsyncGPUModelRunnerOutput`: a step's sampled tokens on their way to the host.

With async scheduling the engine schedules and prepares step N+1 while the device still runs
step N, so step N's sampled ids cannot be waited for inside `execute_model`. They are copied
to pinned host memory on a side stream, behind an event, and the device tensor stays with
the runner so the next step can scatter the ids into its input ids without the host. The
engine calls `get_output()` one step later, when the copy is long done; that is also when
the runner learns the values (its `on_ready` callback replaces the placeholders it wrote).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagoda.kv_transfer.interface import KVConnectorOutput
from pagoda.outputs import AsyncModelRunnerOutput, LogprobsArrays, ModelRunnerOutput
from pagoda.sample.logprobs import LogprobsTensors


class AsyncGPUModelRunnerOutput(AsyncModelRunnerOutput):
    """Holds the device ids until resolved; `get_output()` waits for the copy once and caches."""

    def __init__(
        self,
        req_ids: list[str],
        sample_rows: np.ndarray,
        positions: np.ndarray,
        num_drafts: np.ndarray,
        logits_start: np.ndarray,
        sampled_token_ids: torch.Tensor,
        logprobs: LogprobsTensors | None,
        prompt_logprobs: dict[str, LogprobsArrays],
        copy_stream: torch.cuda.Stream | None,
        on_ready: Callable[[AsyncGPUModelRunnerOutput, np.ndarray], None],
        draft_token_ids: torch.Tensor | None = None,
        position_shifts: torch.Tensor | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.sample_rows = sample_rows
        # Token position each sampled row's first new token lands at: for a row behind its verify
        # step, where the scheduler laid it out until `position_shifts` (on the device, [rows],
        # <= 0: where it was moved, see pagoda/worker/behind_verify.py) come back with the ids.
        self.positions = positions
        # Per sampled row: the drafts it verified, and its first row among the step's logprobs.
        self.num_drafts = num_drafts
        self.logits_start = logits_start
        # The device ids ([rows, n], -1 past a row's last), kept until resolved so the next step
        # can read them without the host.
        self.sampled_token_ids: torch.Tensor | None = sampled_token_ids
        self._prompt_logprobs = prompt_logprobs
        self._on_ready = on_ready
        self._output: ModelRunnerOutput | None = None
        # The KV connector's report of this step, passed on with the tokens.
        self.kv_connector_output: KVConnectorOutput | None = None
        self._copy_done: torch.cuda.Event | None = None
        tensors = [sampled_token_ids]
        if logprobs is not None:
            tensors += [logprobs.token_ids, logprobs.logprobs, logprobs.ranks]
        # Per sampled row, the drafts a draft model proposed after its new tokens ([rows, k], -1 padded).
        self._has_drafts = draft_token_ids is not None
        if draft_token_ids is not None:
            tensors.append(draft_token_ids)
        self._has_shifts = position_shifts is not None
        if position_shifts is not None:
            tensors.append(position_shifts)
        if copy_stream is None:
            self._host = [t.cpu() for t in tensors]
            return
        copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy_stream):
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, device_tensor in zip(self._host, tensors, strict=True):
                host.copy_(device_tensor, non_blocking=True)
                device_tensor.record_stream(copy_stream)
            self._copy_done = torch.cuda.Event()
            self._copy_done.record(copy_stream)

    def sampled_index_of_rows(self, req_ids: list[str]) -> np.ndarray:
        """Per request of `req_ids` (a later step's batch), its index among this step's sampled
        rows, -1 where it did not sample here: vectorized while the batch kept its rows."""
        num_rows = len(self.req_ids)
        if req_ids[:num_rows] == self.req_ids:
            index_of_row = np.full(len(req_ids), -1, dtype=np.int64)
            index_of_row[self.sample_rows] = np.arange(len(self.sample_rows))
            return index_of_row
        index_of_req = {self.req_ids[row]: i for i, row in enumerate(self.sample_rows.tolist())}
        return np.fromiter((index_of_req.get(r, -1) for r in req_ids), dtype=np.int64, count=len(req_ids))

    @property
    def resolved(self) -> bool:
        return self._output is not None

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            output = self.host_output()
            if self._has_shifts:
                self.positions = self.positions + self._host[-1].numpy()
            self._on_ready(self, self._host[0].numpy())
            self._output = output
            self.sampled_token_ids = None
        return self._output

    def host_token_ids(self) -> np.ndarray:
        """[rows, n] the sampled ids on the host, once their copy is done; safe from another
        thread (the grammar pipeline's)."""
        if self._copy_done is not None:
            self._copy_done.synchronize()
        return self._host[0].numpy()

    def host_output(self) -> ModelRunnerOutput:
        """Wait for the copy and build the step's output from the host copies alone, without
        telling the runner: safe from another thread (a worker process's output sender)."""
        sampled = self.host_token_ids()
        sample_rows = self.sample_rows.tolist()
        if sampled.shape[1] == 1:
            new_tokens = [[token_id] for token_id in sampled[:, 0].tolist()]
        else:  # a verify step: each row's accepted tokens, then -1
            new_tokens = [[token_id for token_id in tokens if token_id >= 0] for tokens in sampled.tolist()]
        if len(sample_rows) == len(self.req_ids):
            sampled_token_ids = new_tokens  # every row sampled, in row order (a decode step)
        else:
            sampled_token_ids = [[] for _ in self.req_ids]
            for row, tokens in zip(sample_rows, new_tokens, strict=True):
                sampled_token_ids[row] = tokens
        host = self._host[: len(self._host) - self._has_drafts - self._has_shifts]
        draft_token_ids = None
        if self._has_drafts:
            draft_token_ids = [[] for _ in self.req_ids]
            for row, drafts in zip(self.sample_rows.tolist(), self._host[len(host)].numpy(), strict=True):
                draft_token_ids[row] = drafts[drafts >= 0].tolist()
        logprobs = logprobs_start = None
        if len(host) > 1:
            logprobs = LogprobsArrays(*(tensor.numpy() for tensor in host[1:]))
            logprobs_start = [-1] * len(self.req_ids)
            for row, start in zip(self.sample_rows.tolist(), self.logits_start.tolist(), strict=True):
                logprobs_start[row] = start
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            req_id_to_index=dict(zip(self.req_ids, range(len(self.req_ids)), strict=True)),
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            logprobs_start=logprobs_start,
            prompt_logprobs=self._prompt_logprobs,
            draft_token_ids=draft_token_ids,
            kv_connector_output=self.kv_connector_output,
        )


class DeferredSampleOutput(AsyncModelRunnerOutput):
    """A step whose forward is queued and whose sampling is not yet: the runner queues it
    (`sample`, once) at the start of its next step, or here when the step is resolved first.

    Why: a step under grammars samples through masks that need the previous step's ids on
    the host and the grammar thread's work on them. Sampling at the end of `execute_model`
    puts that wait between the forward's launch and the engine's work on the previous step's
    outputs; sampling at the next step's start lets both run at once, ahead of the next
    forward. Only for a runner whose outputs are resolved on its own thread (in-process)."""

    def __init__(self, sample: Callable[[], ModelRunnerOutput | AsyncModelRunnerOutput]) -> None:
        self._sample: Callable[[], ModelRunnerOutput | AsyncModelRunnerOutput] | None = sample
        self._sampled: ModelRunnerOutput | AsyncModelRunnerOutput | None = None

    def sample(self) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Queue the step's sampling (the first call only) and return its output."""
        if self._sample is not None:
            self._sampled, self._sample = self._sample(), None
        assert self._sampled is not None
        return self._sampled

    def get_output(self) -> ModelRunnerOutput:
        output = self.sample()
        return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output
