"""aioserve: an OpenAI-compatible LLM server on one uvloop event loop per rank."""

from aioserve.llm import LLM, GenerationOutput
from aioserve.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
__version__ = "0.1.0"
