"""NVFP4 numerics for TRIAGE: torchao's quantiser, the learner's W4A4 linears, and the
compressed-tensors checkpoint the vLLM sampler loads.

Submodules: ``quantize`` (fake-quantisation on torchao's ``NVFP4Tensor``), ``learner``
(``convert_to_nvfp4_learner``), ``export`` (calibration, checkpoint iterator and folder),
``modules`` (finding linears under PEFT). Import from them directly; this package imports
nothing heavy.
"""
