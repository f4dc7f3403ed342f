"""NVFP4 for TRIAGE: one set of numerics, one layer rule, the learner's W4A4 linears and the compressed-tensors
checkpoint the vLLM sampler loads.

Submodules, by role (as torchao's ``mx_formats``): ``numerics`` (constants, E2M1/E4M3 rounding, scale rules, the
torchao and vLLM quantisers), ``quantize`` (the compiled fake-quantisers), ``config`` (``NVFP4Config``),
``recipes`` and ``selection`` (which layers run in NVFP4, decided once per model), ``emulated`` (the learner's
emulated W4A4 layer), ``learner`` (``convert_to_nvfp4_learner``, weight-cache invalidation), ``callbacks`` (the
Trainer callback), ``calibration`` (static activation scales), ``export`` (checkpoint iterator and folder),
``modules`` (finding linears under PEFT). Import from them directly; this package imports nothing heavy.
"""
