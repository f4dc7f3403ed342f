"""vLLM helpers shared by the TRIAGE sampler and ``triage-eval``: start an in-process engine, write the
checkpoint it serves, and report which kernels really run.

Source: vLLM 0.31 (CPU worker thread binding, ``LinearBase.quant_method``), issue 4 (deliverable 3).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

SAMPLER_DTYPE = torch.bfloat16
_QUANT_SCALE_SUFFIXES = (".weight_scale", ".weight_global_scale", ".input_global_scale", ".weight_packed")

# SamplingParams fields (settable through TRL's `generation_kwargs`) that change the distribution vLLM samples
# from, and therefore its processed log-probs, away from TRL's `log_softmax(logits / T)`; with their neutral value.
_NEUTRAL_SAMPLING = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logit_bias": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "logits_processors": None,
    "structured_outputs": None,
}
_NEUTRAL_TOP_K = (0, -1, None)


def start_llm(**llm_kwargs):
    """``vllm.LLM(**llm_kwargs)``, leaving this process's threads as they were.

    vLLM's CPU worker binds the process to its cores and replaces ``torch.set_num_threads`` with a
    no-op that warns, which would leave the learner on one thread; torch's own function, the CPU
    affinity and the thread count are put back, also when the engine fails to start.
    """
    from vllm import LLM

    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        return LLM(**llm_kwargs)
    finally:
        torch.set_num_threads = torch._C.set_num_threads
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def model_runner(llm):
    """The in-process model runner of ``llm`` (``reload_weights``, the loaded ``model``)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def finish_sampler_checkpoint(out_dir: str | os.PathLike) -> None:
    """Make a saved checkpoint hold what the sampler serves: floating tensors other than NVFP4 data and
    scales in bf16 (``model.safetensors``), and ``config.json`` saying so (vLLM reads the dtype there)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    path = out / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:  # reads headers only
        cast = any(needs_cast(n, f.get_slice(n)) for n in f.keys())
    if cast:
        tensors = load_file(str(path))
        save_file({n: (to_sampler_dtype(t) if needs_cast(n, t) else t) for n, t in tensors.items()},
                  str(path), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = cfg["dtype"] = str(SAMPLER_DTYPE).removeprefix("torch.")
    cfg_path.write_text(json.dumps(cfg, indent=2))


def inspect_kernels(llm, precision: str, checkpoint_dir=None) -> dict[str, str]:
    """Which linear kernels and precisions the engine really runs (for logs and model cards).

    Args:
        llm: an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        precision: the precision the checkpoint was written in, ``"bf16"`` or ``"nvfp4"``.
        checkpoint_dir: the served checkpoint, named in the error.

    Returns:
        ``{"platform", "sampler_precision", "dtype", "weights", "activations", "linear_kernels"[, "gemm"]}``.

    Raises:
        RuntimeError: ``precision="nvfp4"`` but vLLM loaded no NVFP4 linear layer.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.platforms import current_platform

    model = model_runner(llm).model
    counts: dict[str, int] = {}
    gemms: set[str] = set()
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        method = getattr(module, "quant_method", None)
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme, "kernel", None) or getattr(method, "kernel", None)
        label = type(kernel).__name__ if kernel is not None else type(method).__name__
        if scheme is not None:
            label = f"{type(scheme).__name__}/{label}"
        counts[label] = counts.get(label, 0) + 1
        cache = getattr(module, "nvfp4_dequantised", None)
        if cache is not None:
            gemms.add(cache.gemm_name)
    kernels = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
    nvfp4 = [k for k in counts if "Fp4" in k or "FP4" in k.upper()]
    weight_only = any("A16" in k or "Marlin" in k for k in nvfp4)
    if precision == "nvfp4":
        activations = "bf16 (weight-only NVFP4 kernel)" if weight_only else "nvfp4 (static per-tensor scale)"
        weights = "nvfp4 (E2M1, E4M3 block scales /16, fp32 tensor scale)"
    else:
        activations, weights = "bf16", "bf16"
    device = current_platform.device_type
    if device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = f"{torch.cuda.get_device_name()} (sm{major}{minor})"
    report = {
        "platform": device,
        "sampler_precision": precision,
        "dtype": str(SAMPLER_DTYPE).removeprefix("torch."),
        "weights": weights,
        "activations": activations,
        "linear_kernels": kernels,
    }
    if gemms:
        report["gemm"] = ", ".join(sorted(gemms))
    if precision == "nvfp4" and not nvfp4:
        raise RuntimeError(
            f"sampler_precision='nvfp4' but vLLM loaded no NVFP4 linear layer ({kernels}); the checkpoint in "
            f"{checkpoint_dir} was not read as compressed-tensors NVFP4."
        )
    return report


_FLOAT_DTYPES_KEPT = (SAMPLER_DTYPE, torch.float8_e4m3fn)


def needs_cast(name: str, tensor) -> bool:
    """Whether a checkpoint tensor (or safetensors slice) must be cast to the sampler's dtype: floating,
    not already bf16/fp8, and not an NVFP4 scale or packed weight (which keep their own dtypes)."""
    dtype = tensor.dtype if isinstance(tensor, torch.Tensor) else _SAFETENSORS_DTYPES.get(tensor.get_dtype())
    return (
        dtype is not None
        and dtype.is_floating_point
        and dtype not in _FLOAT_DTYPES_KEPT
        and not name.endswith(_QUANT_SCALE_SUFFIXES)
    )


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I64": torch.int64, "I32": torch.int32}


def to_sampler_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy in the sampler's dtype when floating, else the tensor itself."""
    tensor = tensor.detach()
    return tensor.to(SAMPLER_DTYPE) if tensor.is_floating_point() and tensor.dtype != SAMPLER_DTYPE else tensor


def check_comparable_sampling(
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int | None = 0,
    min_p: float | None = 0.0,
    repetition_penalty: float = 1.0,
    generation_kwargs: dict | None = None,
    structured_outputs_regex: str | None = None,
) -> None:
    """Refuse sampling settings under which the sampler's log-probs are not comparable with the learner's.

    TRL's learner scores ``log_softmax(logits / temperature)``; vLLM (``processed_logprobs``) scores the
    distribution it really samples from. They agree only for plain temperature sampling.

    Raises:
        ValueError: ``temperature <= 0``, or any of repetition/presence/frequency penalty, top-k, top-p, min-p,
            min-tokens, logit bias, bad words, allowed token ids, logits processors or structured outputs set to a
            non-neutral value (in the arguments or in ``generation_kwargs``). The message names the setting and the
            neutral value to use.
    """
    settings: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
    }
    settings.update(generation_kwargs or {})
    if structured_outputs_regex is not None:
        settings["structured_outputs"] = structured_outputs_regex
    temp = settings["temperature"]
    if temp is None or not temp > 0 or not math.isfinite(temp):
        raise ValueError(
            f"temperature={temp!r}: the sampler needs a finite temperature > 0. With greedy decoding (0) vLLM returns "
            "unscaled log-probs while the learner divides its logits by the temperature, so the TRIAGE mismatch "
            "would be meaningless. Use temperature > 0 (e.g. 1.0)."
        )
    bad = []
    if settings.get("top_k") not in _NEUTRAL_TOP_K:
        bad.append(f"top_k={settings['top_k']!r} (use 0)")
    for key, neutral in _NEUTRAL_SAMPLING.items():
        value = settings.get(key, neutral)
        if key == "min_p" and value is None:
            continue
        if value != neutral and not (neutral is None and not value):
            bad.append(f"{key}={value!r} (use {neutral!r})")
    if bad:
        raise ValueError(
            "These sampling settings make the sampler's log-probs incomparable with the learner's: "
            + ", ".join(bad)
            + ". vLLM reports log-probs after penalties, truncation and masks (logprobs_mode='processed_logprobs') "
            "while TRL's learner scores log_softmax(logits / temperature) only, so TRIAGE would count the "
            "difference as sampler/learner mismatch. Sample with temperature only."
        )
