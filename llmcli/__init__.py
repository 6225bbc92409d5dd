"""llmcli: offline batch generation with LLMs on a paged-attention engine of its own."""
from __future__ import annotations

from llmcli.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; importing the package for its CLI help should not.
    if name == "LLM":
        from llmcli.llm import LLM

        return LLM
    raise AttributeError(f"module 'llmcli' has no attribute {name!r}")
