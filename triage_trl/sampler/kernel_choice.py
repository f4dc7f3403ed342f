"""Which NVFP4 linear kernel the vLLM sampler runs, chosen explicitly so both engines run one recipe.

vLLM 0.31 picks an NVFP4 linear kernel per layer (``init_nvfp4_linear_kernel``): W4A4 kernels (CUTLASS, FlashInfer)
need sm100+, and below that its CUDA list falls through to **weight-only** kernels (Marlin: FP4 weights, bf16
activations) before its W4A4 emulation. The learner quantises activations, so on Hopper the two engines would run
different recipes. ``nvfp4_sampler_kernel`` makes the choice explicit:

* ``w4a4``: vLLM's own choice, which must be a W4A4 kernel (the project's CPU kernel on CPU);
* ``w4a4_emulation``: vLLM's W4A4 emulation (dequantise, bf16 GEMM; the per-quantisation linear backend
  ``kernel_config.linear_backend_per_quant={"nvfp4_w4a4": "emulation"}``; vLLM's ``EmulationNvFp4LinearKernel`` on CPU);
* ``weight_only``: Marlin (``{"nvfp4_w4a4": "marlin"}``), with the learner's activations unquantised too (W4A16);
* ``auto``: ``w4a4`` on CPU and sm100+, ``w4a4_emulation`` on older GPUs.

After the engine starts, :func:`check_sampler_kernel` compares the recipe chosen with the kernels vLLM loaded
(``vllm_engine.inspect_kernels``) and refuses a mismatch.

Source: vLLM 0.31 ``model_executor/kernels/linear/__init__.py`` (``init_nvfp4_linear_kernel``,
``_get_linear_backend``) and ``config/kernel.py`` (``KernelConfig.linear_backend_per_quant``).
"""

from __future__ import annotations

__all__ = ["check_sampler_kernel", "resolve_sampler_kernel", "sampler_kernel_engine_kwargs"]

W4A4_MIN_CAPABILITY = 100  # vLLM's CUTLASS / FlashInfer W4A4 NVFP4 GEMMs: sm100+


def resolve_sampler_kernel(choice: str, device: str, capability: int | None = None) -> tuple[str, str]:
    """The NVFP4 sampler kernel a run uses, and why (for the log and the kernel report).

    Args:
        choice: ``nvfp4_sampler_kernel`` (``"auto"``, ``"w4a4"``, ``"w4a4_emulation"``, ``"weight_only"``).
        device: vLLM's platform, ``"cpu"`` or ``"cuda"``.
        capability: the GPU's compute capability as vLLM writes it (``90`` for sm90); ``None`` on CPU.

    Returns:
        ``(kernel, reason)``, ``kernel`` one of ``"w4a4"``, ``"w4a4_emulation"``, ``"weight_only"``.

    Raises:
        ValueError: ``weight_only`` on CPU (vLLM has no weight-only NVFP4 CPU kernel); ``w4a4`` on a GPU below
            sm100 (vLLM would run weight-only Marlin); the message names the setting to use instead.
    """
    gpu = device != "cpu"
    native_w4a4 = not gpu or (capability is not None and capability >= W4A4_MIN_CAPABILITY)
    where = f"sm{capability}" if gpu else "CPU"
    if choice == "auto":
        if native_w4a4:
            return "w4a4", f"auto: {where} has a W4A4 NVFP4 kernel"
        return "w4a4_emulation", (f"auto: {where} has no W4A4 NVFP4 kernel; vLLM's W4A4 emulation instead of its "
                                  "weight-only Marlin fallback, so both engines quantise activations")
    if choice == "weight_only" and not gpu:
        raise ValueError(
            "nvfp4_sampler_kernel='weight_only' runs vLLM's weight-only NVFP4 kernel (Marlin), which needs a GPU. "
            "On CPU use nvfp4_sampler_kernel='auto' (W4A4)."
        )
    if choice == "w4a4" and not native_w4a4:
        raise ValueError(
            f"nvfp4_sampler_kernel='w4a4' needs vLLM's W4A4 NVFP4 kernels (sm100+), but this GPU is {where}: vLLM "
            "would run its weight-only Marlin kernel while the learner quantises activations. Use "
            "nvfp4_sampler_kernel='w4a4_emulation' (or 'auto'), or 'weight_only' to make both engines W4A16."
        )
    return choice, f"{choice} by request"


def sampler_kernel_engine_kwargs(kernel: str, device: str) -> dict:
    """``start_engine`` arguments that make vLLM run ``kernel`` (a :func:`resolve_sampler_kernel` result): on CUDA a
    per-quantisation linear backend (``kernel_config``), on CPU the project's ``nvfp4_cpu_kernel``."""
    if device == "cpu":
        return {"nvfp4_cpu_kernel": "emulation" if kernel == "w4a4_emulation" else "fast"}
    backend = {"w4a4_emulation": "emulation", "weight_only": "marlin"}.get(kernel)
    return {"kernel_config": {"linear_backend_per_quant": {"nvfp4_w4a4": backend}}} if backend else {}


def check_sampler_kernel(kernel: str, kernel_report: dict[str, str]) -> None:
    """Refuse an engine whose loaded NVFP4 kernels do not run ``kernel``'s recipe.

    Args:
        kernel: the resolved choice (``"w4a4"``, ``"w4a4_emulation"``, ``"weight_only"``).
        kernel_report: ``vllm_engine.inspect_kernels``'s report (``"linear_kernels"``, ``"activations"``).

    Raises:
        RuntimeError: vLLM runs a weight-only kernel where the learner quantises activations, or the reverse, or
            not its emulation where ``w4a4_emulation`` was asked for; the message names the kernels and the setting.
    """
    kernels = kernel_report.get("linear_kernels", "")
    weight_only = kernel_report.get("activations", "").startswith("bf16 (weight-only")
    problem = None
    if kernel == "weight_only" and not weight_only:
        problem = "the learner leaves activations unquantised (weight_only) but vLLM quantises them"
    elif kernel != "weight_only" and weight_only:
        problem = "vLLM runs a weight-only NVFP4 kernel while the learner quantises activations (W4A4)"
    elif kernel == "w4a4_emulation" and "Emulation" not in kernels:
        problem = "w4a4_emulation was asked for but vLLM did not load its emulation kernel"
    if problem:
        raise RuntimeError(
            f"NVFP4 sampler kernel mismatch: {problem} (loaded: {kernels}). The two engines would run different "
            "recipes. Set nvfp4_sampler_kernel='w4a4_emulation' (W4A4 on any GPU) or 'weight_only' (both W4A16)."
        )
