"""`EncoderCudaGraphManager`: CUDA graphs of a vision encoder whose input has one shape per image
(LLaVA's tower: every image is resized to it), for batches of a few image counts; a batch is
padded with zero images up to the nearest captured count, and its padding outputs are dropped.
Encoders whose patch counts vary by image (Qwen2.5-VL) run eagerly."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Image counts captured (those within one step's encoder budget).
DEFAULT_ENCODER_GRAPH_SIZES = (1, 2, 4, 8)


class EncoderCudaGraphManager:
    def __init__(
        self,
        encode: Callable[[torch.Tensor], torch.Tensor],
        image_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        sizes: list[int],
    ) -> None:
        self.encode = encode
        self.sizes = sorted(sizes)
        self.inputs = torch.zeros((self.sizes[-1], *image_shape), dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def capture(self) -> None:
        """Warm up and record each size, largest first, in one shared memory pool."""
        for size in reversed(self.sizes):
            inputs = self.inputs[:size]
            self.encode(inputs)
            torch.cuda.synchronize()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.encode(inputs)
            self.graphs[size] = graph

    def run(self, pixel_values: torch.Tensor) -> torch.Tensor | None:
        """The encoder's output for `pixel_values` [N, *image_shape] by replaying the nearest graph
        (a view of its static output, valid until the next replay); None when N is over every size."""
        count = len(pixel_values)
        size = next((size for size in self.sizes if size >= count), None)
        if size is None or not self.graphs:
            return None
        self.inputs[:count].copy_(pixel_values)
        self.inputs[count:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:count]
