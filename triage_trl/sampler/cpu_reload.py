"""What vLLM 0.31's in-place ``reload_weights`` leaves stale on its CPU platform, put right after every sync.

Source: vLLM 0.31 ``model_executor/model_loader/reload/layerwise.py`` (a reload re-processes only the layers that
received a tensor), ``UnquantizedEmbeddingMethod.process_weights_after_loading``,
``model_executor/layers/utils.py:dispatch_cpu_unquantized_gemm`` (CPU GEMMs bound to a packed copy of the weight;
on AVX512-BF16 CPUs a convolution weight packed for the C++ ``causal_conv1d`` kernels) and
``model_executor/layers/mamba/mamba_mixer2.py`` (the ``conv_weights`` buffer).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["after_cpu_reload", "refresh_cpu_lm_heads", "refresh_cpu_mamba_conv_weights"]


def refresh_cpu_lm_heads(model: nn.Module) -> int:
    """Bind a loaded vLLM model's tied ``lm_head`` GEMM to its current weight after ``reload_weights``
    (``llm.apply_model``) on vLLM's CPU platform; returns how many heads it rebound (0 elsewhere, and for untied
    heads, which the reload re-processes itself).

    Where oneDNN multiplies the weight's dtype (bf16 on CPUs with AVX512-BF16 or AMX, float32 on any x86 CPU), vLLM's
    CPU GEMM of an unquantised layer multiplies by a copy of the weight packed when the layer was processed. A tied
    ``lm_head`` (SmolLM2, Llama 3.2 1B/3B, small Qwen models) receives no tensor of its own in a reload, so the
    reload never processes it again and it keeps the embedding it was first packed from. The sampler starts on dummy
    weights, so its logits stayed random: measured with SmolLM2-135M on an AVX512-BF16 AMD EPYC, the engine generated
    from the dummy weights after every sync (probe gap 8.4 nats; the AVX2-only CPUs fall back to
    ``torch.nn.functional.linear`` on bf16, which reads the weight and showed nothing). Re-processing the head packs
    its current weight and keeps the weight (vLLM processes heads with ``remove_weight=False``).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead, UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    modules = list(model.modules())
    embeddings = {id(m.weight) for m in modules
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    count = 0
    for module in modules:
        method = getattr(module, "quant_method", None)
        if (isinstance(module, ParallelLMHead) and isinstance(method, UnquantizedEmbeddingMethod)
                and id(module.weight) in embeddings):
            method.process_weights_after_loading(module)
            count += 1
    return count


def refresh_cpu_mamba_conv_weights(model: nn.Module) -> int:
    """Point a loaded vLLM model's Mamba-2 convolutions (``MambaMixer2.conv_weights``) at the weights the last load
    or reload wrote (``llm.apply_model``); returns how many mixers it refreshed (0 where nothing was stale).

    ``MambaMixer2`` registers ``conv_weights`` at construction as a ``[dim, width]`` view of ``conv1d.weight``'s
    storage, and its forward convolves with that view. On a CPU with AVX512-BF16 (vLLM's C++ ``causal_conv1d``
    kernels) the processing of ``conv1d`` replaces ``conv1d.weight.data`` by a VNNI-packed copy and stashes the
    unpacked weight as ``conv1d._cpu_unpacked_conv_weight``; a reload then writes into the packed storage and the
    stash, never into the storage ``conv_weights`` views, so the engine kept convolving with its first (dummy) weights.
    Measured on a tiny NemotronH (hybrid Mamba-2 / attention, bf16 engine) on an AVX512-BF16 AMD EPYC: sync-probe gap
    0.213 nats at the first sync (stale-sampler error), 0.0010 after this refresh, the gap of a fresh engine loading
    the checkpoint itself (0.0010). On AVX2-only CPUs nothing is packed: ``conv_weights`` still views ``conv1d``'s
    weight, which the reload writes, and nothing is copied.
    """
    count = 0
    for module in model.modules():  # registered children and buffers read directly: every sync walks every module,
        view = module._buffers.get("conv_weights")  # and getattr of a missing name raises inside nn.Module
        if view is None or view.is_meta or "conv1d" not in module._modules:
            continue
        source = getattr(module._modules["conv1d"], "_cpu_unpacked_conv_weight", None)
        if source is None:  # nothing was packed (AVX2-only CPUs, GPUs): the view shares the storage the reload writes
            continue
        if source.numel() != view.numel():
            raise RuntimeError(f"Mamba mixer {type(module).__name__}: its conv_weights {tuple(view.shape)} and the "
                               f"loaded convolution weight {tuple(source.shape)} differ in size; this vLLM version "
                               "lays the mixer out differently: sync through another version or report it.")
        if not torch.equal(view, source.reshape(view.shape)):
            view.copy_(source.reshape(view.shape))
            count += 1
    return count


def after_cpu_reload(model: nn.Module, *, lm_heads: bool = True) -> dict[str, int]:
    """Everything a vLLM 0.31 CPU engine needs after ``reload_weights`` (``llm.apply_model``): a tied head's GEMM
    (:func:`refresh_cpu_lm_heads`; ``lm_heads=False`` when the reload did not receive the embedding, which then kept
    its weight and its head's packed copy: ``frozen_vocab.FrozenVocabSkip``), the bf16 MoE experts' layout
    (:func:`triage_trl.nvfp4.experts.repack_cpu_moe_after_reload`) and the Mamba-2 convolutions
    (:func:`refresh_cpu_mamba_conv_weights`). Returns ``{"lm_heads": n, "moe_experts": m, "mamba_conv": k}``, what
    each touched."""
    from ..nvfp4.experts import repack_cpu_moe_after_reload

    heads = refresh_cpu_lm_heads(model) if lm_heads else 0
    return {"lm_heads": heads, "moe_experts": repack_cpu_moe_after_reload(model),
            "mamba_conv": refresh_cpu_mamba_conv_weights(model)}
