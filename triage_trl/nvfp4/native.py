"""torchao's native NVFP4 training path (sm100+): when the learner takes it, and the shapes it needs.

torchao 0.18's ``NVFP4TrainingConfig`` swaps a linear for ``NVFP4Linear``, whose three GEMMs run in NVFP4
(``nvfp4_mm_triton``). Its recipe is not the sampler's:

* weights: one E4M3 scale per **2-D 16x16 block** (``triton_weight_quantize_2d``), vLLM's checkpoint one per 1x16
  row block; both with a dynamic per-tensor scale ``amax / 2688``;
* activations: quantised per 1x16 block with a **dynamic** per-tensor scale (the amax of the whole input, padding
  rows included), where the vLLM sampler uses the static calibrated ``input_global_scale``;
* backward: NVFP4 GEMMs with random Hadamard transforms and stochastic rounding.

So the native learner cannot mirror the sampler's scales (``nvfp4_learner_scales="sampler"``), "4 over 6" or a
weight-only sampler: ``NVFP4Config.native_learner_blockers`` names what stands in the way, ``auto`` then emulates
every layer and an explicit ``nvfp4_learner_kernel="native"`` is refused. The sync probe measures the remaining
learner-sampler gap.

Shapes: ``nvfp4_mm_triton`` requires ``M, K, N`` divisible by 128 with ``M = input.shape[-2]``, the sequence length
of Hugging Face's ``[B, T, K]`` activations. Layers whose K or N are not multiples of 128 stay emulated; the sequence
length comes from TRL's ``pad_to_multiple_of`` (checked at config time by :func:`check_native_padding`) and from the
sync probe's padding. Calibration needs none: it runs the float master model, native layers included
(``calibration.nvfp4_quantizers_disabled``), on unpadded prompts, so padding never enters the activation scales.

Source: torchao 0.18 ``prototype/moe_training/nvfp4_training`` (``nvfp4_training.py``, ``nvfp4_linear.py``,
``quantize_2d_triton.py``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "NATIVE_MULTIPLE",
    "apply_native",
    "check_native_padding",
    "choose_learner_path",
    "native_learner_expected",
    "native_nvfp4_available",
    "native_path_possible",
    "native_sign_vector",
]

NATIVE_MULTIPLE = 128
"""torchao's ``nvfp4_mm_triton``: M (``input.shape[-2]``), K and N divisible by 128."""
_REQUESTS = {"auto": "auto", "native": True, "emulated": False}


def native_nvfp4_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether torchao's native NVFP4 training path can run on ``device`` (default: current CUDA).

    Returns ``(ok, reason)``; needs a CUDA device of compute capability >= 10.0 (sm100) and
    ``torchao.prototype.moe_training.nvfp4_training``.
    """
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False, f"model is on {dev.type}, not CUDA"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 10:
        return False, f"GPU is sm{major}{minor}; torchao's NVFP4 training kernels need sm100+"
    try:
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means no native path
        return False, f"torchao NVFP4 training unavailable ({err})"
    return True, ""


def choose_learner_path(config, native: bool | str | None = None, device=None) -> tuple[bool, str]:
    """Whether the NVFP4 learner runs natively, and why not.

    Args:
        config: an ``NVFP4Config`` (or a ``TriageGRPOConfig``).
        native: ``None`` follows ``config.nvfp4_learner_kernel``; ``True`` requires native, ``False`` emulates,
            ``"auto"`` decides (``convert_to_nvfp4_learner``'s argument).
        device: the model's device.

    Returns:
        ``(native, reason)``: ``reason`` says why not (empty when native).

    Raises:
        ValueError: ``native`` not one of None/True/False/"auto"; native requested but the recipe needs the emulation
            (``config.native_learner_blockers()``) or the GPU has no native kernels.
    """
    request = _REQUESTS[config.nvfp4_learner_kernel] if native is None else native
    if request not in (True, False, "auto"):
        raise ValueError(f"native must be True, False or 'auto', got {native!r}.")
    if request is False:
        return False, "emulated by request"
    blockers = config.native_learner_blockers()
    if blockers and request is True:
        raise ValueError(
            f"native NVFP4 training cannot run this recipe ({'; '.join(blockers)}). Use native=False (or "
            "native='auto', nvfp4_learner_kernel='emulated') for the emulated W4A4 path, or change the settings named."
        )
    if blockers:
        return False, "; ".join(blockers)
    ok, why = native_nvfp4_available(device)
    if request is True and not ok:
        raise ValueError(
            f"native NVFP4 training is unavailable here ({why}). Use native=False (or "
            "native='auto') for the emulated W4A4 path, which runs on any device."
        )
    return ok, why


def native_path_possible(config) -> bool:
    """Whether a learner built from ``config`` can take the native path on some GPU (device not consulted):
    ``learner_precision="nvfp4"``, ``nvfp4_learner_kernel`` not ``"emulated"`` and a recipe torchao's kernels run
    (no ``config.native_learner_blockers()``). Every shipped recipe for which this holds sets ``pad_to_multiple_of``."""
    return (config.learner_precision == "nvfp4" and config.nvfp4_learner_kernel != "emulated"
            and not config.native_learner_blockers())


def native_learner_expected(config, device=None) -> tuple[bool, str]:
    """Whether a learner built from ``config`` here takes the native path (before any model loads), and why.

    ``(True, why)`` for ``learner_precision="nvfp4"`` with ``nvfp4_learner_kernel="native"``, or ``"auto"`` on a GPU
    with native kernels and a recipe they can run; ``(False, why)`` otherwise. Never raises for an unavailable GPU
    (the conversion does).
    """
    if config.learner_precision != "nvfp4":
        return False, "learner_precision is not 'nvfp4'"
    if config.nvfp4_learner_kernel == "native":
        return True, "nvfp4_learner_kernel='native'"
    if not native_path_possible(config):
        return False, "; ".join(config.native_learner_blockers()) or "nvfp4_learner_kernel='emulated'"
    ok, why = native_nvfp4_available(device)
    return (True, "nvfp4_learner_kernel='auto' on a GPU with native NVFP4 training kernels (sm100+)") if ok else (
        False, why)


def check_native_padding(config, device=None) -> None:
    """Refuse a run whose learner takes the native path without sequences padded to a multiple of 128.

    Args:
        config: a ``TriageGRPOConfig`` (TRL's ``pad_to_multiple_of``, the NVFP4 fields).

    Raises:
        ValueError: the native path would be taken (:func:`native_learner_expected`) and ``pad_to_multiple_of`` is
            not a multiple of 128; the message names both fixes.
    """
    expected, why = native_learner_expected(config, device)
    pad = getattr(config, "pad_to_multiple_of", None)
    if not expected or (isinstance(pad, int) and not isinstance(pad, bool) and pad > 0 and pad % NATIVE_MULTIPLE == 0):
        return
    raise ValueError(
        f"The NVFP4 learner takes torchao's native path ({why}), whose kernels need the sequence length "
        f"(input.shape[-2] of every [batch, tokens, features] activation) divisible by {NATIVE_MULTIPLE}, but "
        f"pad_to_multiple_of={pad!r}. Set pad_to_multiple_of={NATIVE_MULTIPLE} (TRL pads prompts and completions to "
        "it), or nvfp4_learner_kernel='emulated'."
    )


def native_sign_vector(seed: int = 0) -> tuple[int, ...]:
    """The 16 random Hadamard signs every native layer uses, the same on every rank (torchao draws one per layer
    and process otherwise, so data-parallel replicas would quantise their gradients in different bases)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(int(v) for v in (torch.randint(0, 2, (16,), generator=g) * 2 - 1))


def apply_native(root: nn.Module, targets: set[int]) -> None:
    """Swap the linears whose ``id`` is in ``targets`` for torchao's ``NVFP4Linear`` (parameters shared), in place."""
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig
    from torchao.quantization import quantize_

    quantize_(root, NVFP4TrainingConfig(rht_sign_vector=native_sign_vector()),
              filter_fn=lambda mod, _fqn: id(mod) in targets)
