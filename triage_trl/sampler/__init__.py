"""The TRIAGE sampler: a colocated vLLM engine (bf16 or NVFP4) kept in sync with the learner."""

from .vllm_generation import SAMPLER_PRECISIONS, TriageVLLMGeneration

__all__ = ["SAMPLER_PRECISIONS", "TriageVLLMGeneration"]
