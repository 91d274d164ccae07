"""The runner calls a KV connector's worker half at the seed's points: metadata bound first,
loads started before the forward, each attention layer's load waited for and its KV handed
on after it (layer-wise connectors, eager steps only), the report attached to the output; a
step carrying a layer-wise connector's jobs never replays a full CUDA graph."""

from __future__ import annotations

import pytest
import torch
from model_utils import save_tiny_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.kv_transfer.interface import KVConnectorMetadata, KVConnectorOutput
from pagoda.scheduler.output import CachedRequestData, SchedulerOutput
from pagoda.worker.cuda_graph import BatchDescriptor, CUDAGraphMode
from pagoda.worker.kv_connector.base import KVConnector


class RecordingConnector(KVConnector):
    uses_layerwise_hooks = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self.calls.append(("bind",))

    def start_load_kv(self) -> None:
        self.calls.append(("start_load",))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata) -> None:
        assert kv_layer.shape[0] == 2  # the layer's K and V cache
        self.calls.append(("save", layer_name))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        self.calls.append(("finished",))
        return KVConnectorOutput(finished_saves=frozenset({"job"}))


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = str(tmp_path_factory.mktemp("llama3"))
    save_tiny_checkpoint("llama3", path)
    return LLM(model=path, device="cpu", dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks=32)


def test_layerwise_hooks_run_around_every_layer(llm: LLM) -> None:
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    default = runner.kv_connector
    connector = RecordingConnector()
    runner.kv_connector = connector
    try:
        outputs = []
        core = llm.llm_engine.engine_core
        original = core.scheduler.update_from_output

        def spy(scheduler_output, model_runner_output):
            outputs.append(model_runner_output.kv_connector_output)
            return original(scheduler_output, model_runner_output)

        core.scheduler.update_from_output = spy
        llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        del core.scheduler.update_from_output
    finally:
        runner.kv_connector = default
    layers = [layer.layer_name for layer in runner._attention_layers()]
    per_layer = [call for name in layers for call in (("wait", name), ("save", name))]
    step = [("bind",), ("start_load",), *per_layer, ("wait_for_save",), ("finished",)]
    assert connector.calls[: 2 * len(step)] == step + step  # prefill, decode
    assert outputs[0] == KVConnectorOutput(finished_saves=frozenset({"job"}))


class AlwaysGraph:
    def descriptor_for(self, num_tokens: int, uniform_decode: bool) -> BatchDescriptor:
        return BatchDescriptor(8, uniform_decode)


def test_layerwise_steps_with_jobs_run_eagerly(llm: LLM) -> None:
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    default, manager = runner.kv_connector, runner.cudagraph_manager
    runner.kv_connector, runner.cudagraph_manager = RecordingConnector(), AlwaysGraph()
    try:
        step = SchedulerOutput([], CachedRequestData(), {"a": 1}, 1)
        assert runner._determine_batch_execution_and_padding(step).cudagraph_mode == CUDAGraphMode.FULL
        step.kv_connector_metadata = KVConnectorMetadata()
        assert runner._determine_batch_execution_and_padding(step).cudagraph_mode == CUDAGraphMode.NONE
        runner.kv_connector = default  # a block-wise connector's steps still replay graphs
        assert runner._determine_batch_execution_and_padding(step).cudagraph_mode == CUDAGraphMode.FULL
    finally:
        runner.kv_connector, runner.cudagraph_manager = default, manager
