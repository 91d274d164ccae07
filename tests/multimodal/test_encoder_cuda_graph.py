"""GPU: LLaVA's vision encoder replayed from CUDA graphs (1, 2 and 4 images within an encoder
budget of 100 tokens) gives the eager encoder's output; more images than the largest graph run
eagerly. (The end-to-end HF comparisons on the CUDA targets replay them in real steps.)"""

from __future__ import annotations

import pytest
import torch
from engine_utils import target_settings

from pagoda.entrypoints.llm import LLM


@pytest.mark.gpu
def test_encoder_graphs_match_eager(tiny_llava) -> None:
    settings = target_settings(("cuda", "triton", True))
    llm = LLM(tiny_llava[0], max_model_len=256, max_num_encoder_input_tokens=100, **settings)
    encoder = llm.llm_engine.engine_core.executor.worker.model_runner.encoder_runner
    graphs = encoder.cuda_graphs
    assert graphs is not None and graphs.captured and graphs.sizes == [1, 2, 4]
    pixels = torch.randn(3, *encoder.model.encoder_graph_input_shape, device="cuda")
    with torch.inference_mode():
        replayed = graphs.run(pixels).clone()
        eager = encoder.model.encode_images(pixels)
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
        assert graphs.run(torch.zeros(5, *encoder.model.encoder_graph_input_shape, device="cuda")) is None
