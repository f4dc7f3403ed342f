"""NVFP4 for TRIAGE: one set of numerics, one layer rule, the learner's W4A4 linears and the compressed-tensors
checkpoint the vLLM sampler loads.

Submodules, by role (as torchao's ``mx_formats``):

- ``numerics``: constants, E2M1/E4M3 rounding, scale rules, the torchao and vLLM quantisers;
- ``quantize``: the compiled fake-quantisers;
- ``config``: ``NVFP4Config``; ``recipes`` and ``selection``: which layers run in NVFP4, decided once per model;
- ``emulated``: the learner's emulated W4A4 layer; ``native``: torchao's native NVFP4 training path (sm100+);
- ``experts``: the learner's MoE experts in NVFP4;
- ``learner``: ``convert_to_nvfp4_learner``, weight-cache invalidation; ``callbacks``: the Trainer callback;
- ``calibration``: static activation scales;
- ``checkpoint_tensors``: the checkpoint's tensors, streamed to the sampler at each sync or saved as a folder;
  ``checkpoint_experts``: the MoE experts' part of it;
- ``modules``: finding linears under PEFT.

Import from them directly; this package imports nothing heavy.
"""
