"""Process-wide settings for in-process vLLM engines, in one place, restored on exit.

An in-process vLLM engine reads environment variables when it starts (and then caches every vLLM variable for the
rest of the process), and its CPU worker binds the process to its cores and replaces ``torch.set_num_threads`` with
a no-op. The demo, the stability lab, ``triage-eval``, the CLI and the tests enter :func:`vllm_process_settings`
around the life of their engines; :func:`preserved_torch_threads` is what every engine start uses so the learner
keeps its threads. Source: vLLM 0.31 ``vllm/envs.py`` (``disable_envs_cache``) and its CPU worker.

The process helpers live beside these settings: ``preflight.py`` (model source, reward columns and prompts checked
before any model loads), ``run_folder.py`` (the output folder's checks and its run lock), ``run_logs.py`` (a run's
``trainer_state.json`` log history), ``progress.py`` (progress lines of long conversions), ``validators.py`` (the
field checks of the settings dataclasses).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping, Sequence

import torch

IN_PROCESS_VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: one-call weight sync, CPU NVFP4 kernel
    "TOKENIZERS_PARALLELISM": "false",  # tokenizers' thread pool would fight the learner for the cores
}
DEFAULT_CPU_KV_CACHE_GIB = 1
# The KV cache size in bytes that vllm_process_settings chose, read by sampler.vllm_engine.start_engine (passed as
# vLLM's `kv_cache_memory_bytes`): VLLM_CPU_KVCACHE_SPACE takes whole GiB only, and while it is set it overrides
# `kv_cache_memory_bytes` on vLLM's CPU platform.
CPU_KV_CACHE_BYTES_ENV = "TRIAGE_CPU_KV_CACHE_BYTES"
# The rendezvous of torch.distributed's default group. A process with an in-process vLLM engine has them set (TRL's
# colocated sampler sets MASTER_PORT to the port its group's store listens on); a child process inheriting them would
# try to listen on that same port.
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@contextlib.contextmanager
def vllm_process_settings(
    *,
    cpu_kv_cache_gib: float | None = None,
    disabled_kernels: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """Environment and threads for in-process vLLM engines started inside the block; everything restored after.

    Args:
        cpu_kv_cache_gib: the KV cache of each engine on vLLM's CPU build, in GiB (fractions allowed, e.g. 0.125 for
            tiny test models). ``None``: ``VLLM_CPU_KVCACHE_SPACE`` (from ``env`` or the environment), else the size
            of an enclosing block, else 1 GiB. Whole GiB also set ``VLLM_CPU_KVCACHE_SPACE`` (vLLM reads only whole
            GiB there); engines started by :func:`triage_trl.sampler.vllm_engine.start_engine` get the exact size as
            ``kv_cache_memory_bytes``.
        disabled_kernels: vLLM linear kernel class names to skip at kernel selection (``VLLM_DISABLED_KERNELS``,
            added to any already set).
        env: further variables to set (``None`` unsets one).

    Sets :data:`IN_PROCESS_VLLM_ENV`, clears vLLM's environment cache on entry and on exit (vLLM caches every
    variable once an engine has started, so later engines of the process would not see the new values), and puts
    back torch's thread count, ``torch.set_num_threads`` and the CPU affinity on exit.

    Raises:
        ValueError: ``cpu_kv_cache_gib`` (or ``VLLM_CPU_KVCACHE_SPACE``) is not a number of GiB of at least 1 MiB.
    """
    values: dict[str, str | None] = dict(IN_PROCESS_VLLM_ENV)
    given = env or {}  # an explicit None there unsets the variable: the size then comes from below
    variable = given["VLLM_CPU_KVCACHE_SPACE"] if "VLLM_CPU_KVCACHE_SPACE" in given else os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE")
    if cpu_kv_cache_gib is not None:
        gib = _positive_gib(cpu_kv_cache_gib)
    elif variable:
        gib = _positive_gib(variable)
    elif os.environ.get(CPU_KV_CACHE_BYTES_ENV):  # inside a block of a fraction of a GiB: keep its exact size
        gib = _positive_gib(_float_or_nan(os.environ[CPU_KV_CACHE_BYTES_ENV]) / 2**30)
    else:
        gib = float(DEFAULT_CPU_KV_CACHE_GIB)
    values["VLLM_CPU_KVCACHE_SPACE"] = str(int(gib)) if gib.is_integer() else None
    values[CPU_KV_CACHE_BYTES_ENV] = str(int(gib * 2**30))
    if disabled_kernels:
        current = [k for k in os.environ.get("VLLM_DISABLED_KERNELS", "").split(",") if k]
        values["VLLM_DISABLED_KERNELS"] = ",".join(dict.fromkeys([*current, *disabled_kernels]))
    values.update(given)
    with environment_overrides(values), preserved_torch_threads():
        yield


def _float_or_nan(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _positive_gib(value) -> float:
    gib = _float_or_nan(value)
    if not 2**-10 <= gib < float("inf"):
        raise ValueError(f"The CPU KV cache must be a number of GiB of at least 1 MiB (2**-10), got {value!r}: pass "
                         "vllm_process_settings(cpu_kv_cache_gib=...) or set VLLM_CPU_KVCACHE_SPACE, e.g. 1.")
    return gib


@contextlib.contextmanager
def environment_overrides(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set environment variables for the block (``None`` removes one) and put back what was there before (also on
    error); vLLM's environment cache is cleared on entry and exit so engines started inside read the new values."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _clear_vllm_env_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _clear_vllm_env_cache()


@contextlib.contextmanager
def preserved_torch_threads() -> Iterator[None]:
    """Put back torch's own ``set_num_threads``, the thread count and the CPU affinity when the block exits (also on
    error). vLLM's CPU worker binds the process to its cores and makes ``torch.set_num_threads`` a warning no-op,
    which would leave the learner on one thread."""
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        torch.set_num_threads = torch._C.set_num_threads
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def child_process_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child process that starts its own run (a lab worker, a test's launcher):
    without the torch.distributed rendezvous variables (``RENDEZVOUS_ENV``) and this process's exact KV cache size
    (``CPU_KV_CACHE_BYTES_ENV``: the child's own ``vllm_process_settings`` chooses, from ``VLLM_CPU_KVCACHE_SPACE`` or
    its default), but with a ``MASTER_PORT`` of its own (a free port now: left unset, accelerate gives every such child
    29500, and two at once collide), plus ``extra``."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    env = {k: v for k, v in os.environ.items() if k not in (*RENDEZVOUS_ENV, CPU_KV_CACHE_BYTES_ENV)}
    env["MASTER_PORT"] = str(get_free_port())
    env.update(extra)
    return env


@functools.cache
def native_bf16_gemm(device_type: str = "cpu") -> bool:
    """Whether bf16 matrix products run natively on this machine's ``device_type``: any CUDA device, or a CPU with
    AVX512-BF16 or AMX (oneDNN's bf16 kernels).

    Elsewhere (e.g. AVX2-only CPUs) torch emulates bf16 GEMMs, measured 10x to 500x slower than float32 here, so the
    NVFP4 layers (the sampler's CPU kernel, the emulated learner) multiply their bf16-exact operands in float32 and
    round the product to bf16: the same values up to the accumulation order.
    """
    if device_type != "cpu":
        return True
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def engine_dtype(device_type: str = "cpu") -> torch.dtype:
    """The dtype both engines compute in on ``device_type`` (where a GPU would run bf16): ``torch.bfloat16`` where bf16
    GEMMs run natively (any GPU, :func:`native_bf16_gemm` on CPU), else ``torch.float32``.

    On a CPU without bf16 instructions (AVX2 only) every bf16 GEMM torch or vLLM runs is emulated, 10-500x slower than
    float32, so there the sampler (vLLM's own layers: attention, norms, ``lm_head``; and the NVFP4 kernel's products)
    and the learner's NVFP4 layers compute in float32. NVFP4 operands are exact in bf16, so the NVFP4 layers compute
    the same products either way, up to the rounding of the output; the unquantised layers keep more precision.
    """
    return torch.bfloat16 if device_type != "cpu" or native_bf16_gemm("cpu") else torch.float32


def compute_dtype_reason(device_type: str = "cpu") -> str:
    """:func:`engine_dtype` on ``device_type`` and why, in words (for ``triage-trl env``, the log and the card)."""
    if engine_dtype(device_type) is torch.float32:
        return "float32 (this CPU has no AVX512-BF16 or AMX: bf16 GEMMs would be emulated, 10-500x slower)"
    where = "this CPU has AVX512-BF16 or AMX" if device_type == "cpu" else device_type
    return f"bfloat16 ({where}: native bf16 GEMMs)"


def check_learner_dtype(model: torch.nn.Module, device_type: str = "cpu") -> str:
    """Log the compute dtype chosen for ``device_type`` (:func:`compute_dtype_reason`) and warn when ``model`` holds
    bf16 parameters on a CPU without bf16 instructions (its unquantised GEMMs then run emulated, 10-500x slower than
    float32: load it with ``model_init_kwargs={"dtype": "float32"}``). Returns the logged line."""
    import logging

    log = logging.getLogger("triage_trl")
    line = f"Compute dtype on {device_type}: {compute_dtype_reason(device_type)}"
    log.info(line)
    if device_type == "cpu" and not native_bf16_gemm("cpu") and any(
            p.dtype == torch.bfloat16 for p in model.parameters()):
        log.warning("The learner holds bf16 parameters on a CPU without bf16 instructions: its bf16 GEMMs are "
                    "emulated, 10-500x slower than float32. Load it in float32 (model_init_kwargs={'dtype': "
                    "'float32'}); the NVFP4 layers and the sampler compute in float32 here either way.")
    return line


def _clear_vllm_env_cache() -> None:
    try:
        from vllm import envs
    except ImportError:  # vLLM is optional for the objective and the NVFP4 numerics
        return
    envs.disable_envs_cache()
