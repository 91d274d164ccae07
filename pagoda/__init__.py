"""Pagoda: a fast LLM inference engine."""

from pagoda.entrypoints.llm import LLM
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
