"""NVFP4 numerics for TRIAGE: torchao's quantiser, the learner's W4A4 linears, and the
compressed-tensors checkpoint the vLLM sampler loads.

Submodules, by role (as torchao's ``mx_formats``): ``numerics`` (constants, E2M1/E4M3 rounding, scale rules, the
torchao and vLLM quantisers), ``quantize`` (the compiled fake-quantisers), ``learner``
(``convert_to_nvfp4_learner``), ``export`` (calibration, checkpoint iterator and folder),
``modules`` (finding linears under PEFT). Import from them directly; this package imports
nothing heavy.
"""
