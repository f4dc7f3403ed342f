"""What vLLM 0.31's in-place ``reload_weights`` leaves stale on its CPU platform, put right after every sync.

Source: vLLM 0.31 ``model_executor/model_loader/reload/layerwise.py`` (a reload re-processes only the layers that
received a tensor), ``UnquantizedEmbeddingMethod.process_weights_after_loading`` and
``model_executor/layers/utils.py:dispatch_cpu_unquantized_gemm`` (CPU GEMMs bound to a packed copy of the weight).
"""

from __future__ import annotations

from torch import nn

__all__ = ["after_cpu_reload", "refresh_cpu_lm_heads"]


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


def after_cpu_reload(model: nn.Module, *, lm_heads: bool = True) -> dict[str, int]:
    """Everything a vLLM 0.31 CPU engine needs after ``reload_weights`` (``llm.apply_model``): a tied head's GEMM
    (:func:`refresh_cpu_lm_heads`; ``lm_heads=False`` when the reload did not receive the embedding, which then kept
    its weight and its head's packed copy: ``frozen_vocab.FrozenVocabSkip``) and the bf16 MoE experts' layout
    (:func:`triage_trl.nvfp4.experts.repack_cpu_moe_after_reload`). Returns ``{"lm_heads": n, "moe_experts": m}``,
    what each touched."""
    from ..nvfp4.experts import repack_cpu_moe_after_reload

    heads = refresh_cpu_lm_heads(model) if lm_heads else 0
    return {"lm_heads": heads, "moe_experts": repack_cpu_moe_after_reload(model)}
