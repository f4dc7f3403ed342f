"""The project's one vLLM start, used by the TRIAGE sampler and ``triage-eval``: write the checkpoint the engine
serves, start an in-process ``vllm.LLM`` on it, and report which kernels really run.

Source: vLLM 0.31 (``register_linear_kernel``, ``VLLM_DISABLED_KERNELS``, ``LLM.apply_model``,
``LinearBase.quant_method``); the checkpoint formats in ``docs/nvfp4.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import torch

from ..runtime import CPU_KV_CACHE_BYTES_ENV, engine_dtype, environment_overrides, preserved_torch_threads

CHECKPOINT_DTYPE = torch.bfloat16
"""The dtype of the unquantised tensors in the checkpoints written for serving (``triage-export``), as vLLM serves
models on GPUs."""
NVFP4CpuKernel = Literal["fast", "emulation"]
_QUANT_SCALE_SUFFIXES = (".weight_scale", ".weight_global_scale", ".input_global_scale", ".weight_packed")
_REGISTERED_CPU_KERNELS: set[str] = set()

__all__ = [
    "CHECKPOINT_DTYPE",
    "finish_sampler_checkpoint",
    "inspect_kernels",
    "needs_cast",
    "sampler_tensors",
    "sampler_dtype",
    "start_engine",
    "to_sampler_dtype",
    "write_engine_checkpoint",
]


def sampler_dtype() -> torch.dtype:
    """The dtype an engine started here computes in and holds its unquantised tensors in:
    ``triage_trl.runtime.engine_dtype`` of vLLM's platform (bf16 on GPUs and on CPUs with AVX512-BF16 or AMX,
    float32 on CPUs without bf16 instructions, where every bf16 GEMM is emulated)."""
    from vllm.platforms import current_platform

    return engine_dtype("cpu" if current_platform.is_cpu() else "cuda")


_MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _is_moe_checkpoint(checkpoint_dir) -> bool:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text())
    config = {**config, **(config.get("text_config") or {})}
    return any(int(config.get(key, 0) or 0) > 0 for key in _MOE_CONFIG_KEYS)


def _ensure_expert_group(tensor_parallel_size: int) -> None:
    """Create vLLM's expert-parallel group if this process's shared parallel groups have none. vLLM 0.31 makes it
    only when the process's first engine serves a MoE model (``initialize_model_parallel``), so a MoE engine started
    next to a dense one failed with "expert parallel group is not initialized"; :func:`start_engine` adds it before a
    MoE engine starts and after any engine started (an unused group for a dense one). Colocated engines have no data
    or context parallelism: its groups are the TP groups."""
    from vllm.distributed import parallel_state as ps

    if ps._EP is not None or not ps.model_parallel_is_initialized():
        return
    world = ps.get_world_group()
    ranks = [list(range(i, i + tensor_parallel_size)) for i in range(0, world.world_size, tensor_parallel_size)]
    ps._EP = ps.init_model_parallel_group(ranks, world.local_rank, torch.distributed.get_backend(world.device_group),
                                          group_name="ep")


CPU_BLOCK_SIZE = 32
"""KV-cache block (tokens) of the engine on vLLM's CPU platform, instead of its default 128. vLLM's prefix cache
reuses full blocks only, and a 113-token prompt (the demo's) never fills a 128-token block: the 8 completions of a
prompt each prefilled it again, and 128 held-out prompts sharing a 92-token chat preamble shared none of it. 32 is the
smallest block the CPU attention accepts. Measured side by side on SmolLM2-135M in float32 (2-core AVX2 EPYC, with
another job on the machine): 128 greedy held-out answers 154 -> 73 s, 2 prompts x 8 completions 35-43 -> 27-29 s."""


def start_engine(
    checkpoint_dir: str | os.PathLike,
    precision: str,
    *,
    nvfp4_cpu_kernel: NVFP4CpuKernel = "fast",
    **llm_kwargs,
):
    """Start ``vllm.LLM`` in this process on a checkpoint written by :func:`write_engine_checkpoint`.

    Args:
        checkpoint_dir: the folder served (model and tokenizer).
        precision: ``"bf16"`` or ``"nvfp4"`` (the checkpoint's format; checked against the loaded layers).
        nvfp4_cpu_kernel: on vLLM's CPU platform, which NVFP4 linear kernel runs: ``"fast"``
            (:class:`~triage_trl.sampler.cpu_kernel.FastCpuNvFp4LinearKernel`) or ``"emulation"`` (vLLM's own
            ``EmulationNvFp4LinearKernel``, a reference). Both are registered through vLLM's public
            ``register_linear_kernel``; the other one is skipped through ``VLLM_DISABLED_KERNELS`` at start.
        **llm_kwargs: ``vllm.LLM`` arguments; ours (:func:`sampler_dtype`, the checkpoint's tokenizer, eager and
            :data:`CPU_BLOCK_SIZE` on CPU, and there the KV cache size :func:`triage_trl.runtime.vllm_process_settings`
            chose, as ``kv_cache_memory_bytes``) are defaults. A ``kv_cache_memory_bytes`` given here wins over
            ``VLLM_CPU_KVCACHE_SPACE``.

    Returns:
        ``(llm, kernel_report)``: the engine and :func:`inspect_kernels`'s report.

    Raises:
        ValueError: NVFP4 on vLLM's CPU platform with the engine core in a subprocess
            (``VLLM_ENABLE_V1_MULTIPROCESSING=1`` and no ``external_launcher``): our CPU kernel is registered in
            this process. Enter :func:`triage_trl.runtime.vllm_process_settings` first.
        RuntimeError: ``precision="nvfp4"`` but vLLM loaded no NVFP4 layer.
    """
    from vllm import LLM
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    in_process = (
        os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        or llm_kwargs.get("distributed_executor_backend") == "external_launcher"
    )
    disabled: tuple[str, ...] = ()
    if precision == "nvfp4" and on_cpu:
        if not in_process:
            raise ValueError(
                "NVFP4 on vLLM's CPU platform runs a kernel registered in this process, but the engine core would "
                "start in a subprocess. Wrap the run in `with triage_trl.runtime.vllm_process_settings():` (or set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0)."
            )
        disabled = _register_cpu_nvfp4_kernels(nvfp4_cpu_kernel)
    kwargs = dict(model=str(checkpoint_dir), tokenizer=str(checkpoint_dir), dtype=sampler_dtype())
    if on_cpu:
        kwargs["enforce_eager"] = True
        kwargs["block_size"] = CPU_BLOCK_SIZE
    kwargs.update(llm_kwargs)
    overrides: dict[str, str | None] = {}
    if on_cpu:
        chosen = int(os.environ.get(CPU_KV_CACHE_BYTES_ENV) or 0)
        as_set = str(chosen >> 30) if chosen % 2**30 == 0 else None  # what vllm_process_settings set the variable to
        # a variable set since vllm_process_settings chose the size (it then differs) wins, as vLLM would let it
        if kwargs.get("kv_cache_memory_bytes") is None and chosen and os.environ.get(
                "VLLM_CPU_KVCACHE_SPACE") in (None, "", as_set):
            kwargs["kv_cache_memory_bytes"] = chosen
        if kwargs.get("kv_cache_memory_bytes") is not None:  # else vLLM's CPU platform lets the variable win
            overrides["VLLM_CPU_KVCACHE_SPACE"] = None
    if disabled:
        overrides["VLLM_DISABLED_KERNELS"] = ",".join(
            [*filter(None, os.environ.get("VLLM_DISABLED_KERNELS", "").split(",")), *disabled])
    tensor_parallel_size = int(kwargs.get("tensor_parallel_size") or 1)
    if _is_moe_checkpoint(checkpoint_dir):
        _ensure_expert_group(tensor_parallel_size)
    triton_overrides = _cpu_triton_overrides_once() if on_cpu and in_process else contextlib.nullcontext()
    with environment_overrides(overrides), preserved_torch_threads(), triton_overrides:
        llm = LLM(**kwargs)
    _ensure_expert_group(tensor_parallel_size)  # for MoE engines started next to this one
    if not in_process:
        return llm, {"sampler_precision": precision, "linear_kernels": "not inspected (engine core in a subprocess)"}
    return llm, inspect_kernels(llm, precision, checkpoint_dir)


@contextlib.contextmanager
def _cpu_triton_overrides_once() -> Iterator[None]:
    """Inside the block, an in-process engine's worker skips vLLM's CPU Triton-kernel overrides when an earlier engine
    of this process registered them.

    vLLM 0.31 registers them at every worker start (``CpuPlatform.register_triton_kernel_overrides``, through
    ``vllm.triton_utils.dispatcher.register_kernels``): each registration scans every attribute of every loaded
    module to rebind the kernels (0.43 s a start, measured with torch, transformers and vLLM imported) and wraps the
    previous registration's wrappers again. The wrappers stay bound for the process, so the second and later engines
    run the same C++ fallbacks without it. Nothing is skipped when no override is registered yet, or when vLLM has
    no such registry (another vLLM version: its own behaviour then)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    platform = type(current_platform)
    original = vars(platform).get("register_triton_kernel_overrides")
    if original is None or not getattr(dispatcher, "_registry", None):
        yield
        return
    platform.register_triton_kernel_overrides = classmethod(lambda cls: None)
    try:
        yield
    finally:
        platform.register_triton_kernel_overrides = original


def _register_cpu_nvfp4_kernels(chosen: NVFP4CpuKernel) -> tuple[str, ...]:
    """Register both CPU NVFP4 kernels once per process; return the class names to disable for ``chosen``."""
    from vllm.model_executor.kernels.linear import EmulationNvFp4LinearKernel, register_linear_kernel
    from vllm.platforms import PlatformEnum

    from .cpu_kernel import FastCpuNvFp4LinearKernel

    kernels = {"fast": FastCpuNvFp4LinearKernel, "emulation": EmulationNvFp4LinearKernel}
    if chosen not in kernels:
        raise ValueError(f"nvfp4_cpu_kernel={chosen!r} is invalid: use 'fast' or 'emulation'.")
    for kernel in kernels.values():
        if kernel.__name__ not in _REGISTERED_CPU_KERNELS:
            register_linear_kernel(kernel, PlatformEnum.CPU, "nvfp4")
            _REGISTERED_CPU_KERNELS.add(kernel.__name__)
    return tuple(k.__name__ for name, k in kernels.items() if name != chosen)


def write_engine_checkpoint(
    out_dir: str | os.PathLike,
    precision: str,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config,
    tokenizer,
    quantization_config=None,
    *,
    dtype: torch.dtype = CHECKPOINT_DTYPE,
) -> Path:
    """Write the folder an engine serves: ``model.safetensors`` (floating tensors other than NVFP4 data and scales
    in ``dtype``), ``config.json`` (``dtype``, and the compressed-tensors ``quantization_config`` for NVFP4) and the
    tokenizer.

    Args:
        out_dir: created if missing; files are overwritten.
        precision: ``"bf16"`` or ``"nvfp4"``.
        named_tensors: checkpoint-format ``(name, tensor)`` pairs (for NVFP4, from the NVFP4 export's iterator).
        config: the model's ``PretrainedConfig``.
        tokenizer: saved alongside (``None``: not saved).
        quantization_config: compressed-tensors ``QuantizationConfig`` (required for ``"nvfp4"``).
        dtype: of the unquantised tensors and in ``config.json`` (default :data:`CHECKPOINT_DTYPE`, bf16; the
            sampler's structural checkpoint uses :func:`sampler_dtype`).

    Raises:
        ValueError: ``"nvfp4"`` without a ``quantization_config``.
    """
    from safetensors.torch import save_file

    if precision == "nvfp4" and quantization_config is None:
        raise ValueError("an NVFP4 engine checkpoint needs its compressed-tensors quantization_config.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in sampler_tensors(named_tensors, dtype)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    if quantization_config is not None:
        from compressed_tensors.compressors import ModelCompressor

        ModelCompressor(quantization_config=quantization_config).update_config(str(out))
    finish_sampler_checkpoint(out, dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def finish_sampler_checkpoint(out_dir: str | os.PathLike, dtype: torch.dtype = CHECKPOINT_DTYPE) -> None:
    """Make ``config.json`` say the checkpoint holds ``dtype`` (vLLM reads the dtype there), and check it parses."""
    cfg_path = Path(out_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg_path.write_text(json.dumps(cfg, indent=2))


def inspect_kernels(llm, precision: str, checkpoint_dir=None) -> dict[str, str]:
    """Which linear kernels and precisions the engine really runs (for logs and model cards).

    Args:
        llm: an in-process ``vllm.LLM``.
        precision: the precision the checkpoint was written in, ``"bf16"`` or ``"nvfp4"``.
        checkpoint_dir: the served checkpoint, named in the error.

    Returns:
        ``{"platform", "sampler_precision", "dtype" (what the engine computes in), "weights", "activations", "linear_kernels"[, "gemm"][,
        "moe_kernels"]}`` (``moe_kernels`` for MoE models: ``nvfp4.experts.vllm_moe_kernel_counts``).

    Raises:
        RuntimeError: ``precision="nvfp4"`` but vLLM loaded no NVFP4 linear layer.
    """
    from vllm.platforms import current_platform

    counts, gemms = llm.apply_model(_count_linear_kernels)[0]
    kernels = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
    nvfp4 = [k for k in counts if "FP4" in k.upper()]
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
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "weights": weights,
        "activations": activations,
        "linear_kernels": kernels,
    }
    if gemms:
        report["gemm"] = ", ".join(sorted(gemms))
    from ..nvfp4.experts import vllm_moe_kernel_counts

    moe = llm.apply_model(vllm_moe_kernel_counts)[0]
    if moe:  # MoE models: bf16 experts run UnquantizedFusedMoEMethod
        report["moe_kernels"] = ", ".join(f"{name} x{n}" for name, n in sorted(moe.items()))
    if precision == "nvfp4" and not nvfp4:
        raise RuntimeError(
            f"sampler_precision='nvfp4' but vLLM loaded no NVFP4 linear layer ({kernels}); the checkpoint in "
            f"{checkpoint_dir} was not read as compressed-tensors NVFP4."
        )
    return report


def _count_linear_kernels(model) -> tuple[dict[str, int], set[str]]:
    """Per linear-kernel label, how many of the model's linear layers run it; and the fast CPU kernel's GEMM paths."""
    from vllm.model_executor.layers.linear import LinearBase

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
    return counts, gemms


def needs_cast(name: str, tensor: torch.Tensor, dtype: torch.dtype = CHECKPOINT_DTYPE) -> bool:
    """Whether a checkpoint tensor must be cast to ``dtype``: floating, not already ``dtype`` or fp8, and not an NVFP4
    scale or packed weight (which keep their own dtypes)."""
    return (
        tensor.dtype.is_floating_point
        and tensor.dtype not in (dtype, torch.float8_e4m3fn)
        and not name.endswith(_QUANT_SCALE_SUFFIXES)
    )


def to_sampler_dtype(tensor: torch.Tensor, dtype: torch.dtype = CHECKPOINT_DTYPE) -> torch.Tensor:
    """A detached copy in ``dtype`` when floating, else the tensor itself (detached, not copied, when it is already
    ``dtype``)."""
    tensor = tensor.detach()
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def sampler_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = CHECKPOINT_DTYPE
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs as an engine of ``dtype`` stores them (floating tensors other than NVFP4 data and
    scales in ``dtype``; a float32 engine takes float32 master weights without a copy)."""
    for name, tensor in named_tensors:
        yield name, (to_sampler_dtype(tensor, dtype) if needs_cast(name, tensor, dtype) else tensor)
