"""What the ranks of a multi-process run must agree on before the sampler loads weights: whether every rank
holds its weights whole, and the NVFP4 activation scales (identical on every rank)."""

from __future__ import annotations

import torch

__all__ = ["all_ranks_agree", "reduce_input_global_scales"]


def all_ranks_agree(flag: bool, accelerator) -> bool:
    """``flag`` AND-reduced over every process (a collective; ``flag`` itself with one process)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([1 if flag else 0], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item() == accelerator.num_processes)


def reduce_input_global_scales(scales: dict[str, torch.Tensor], accelerator) -> dict[str, torch.Tensor]:
    """The NVFP4 activation global scales every rank will use: per layer the minimum over ranks.

    A global scale is ``448 * 6 / amax`` (a divisor, monotone decreasing in ``amax``), so the minimum scale is the
    scale of the largest activation any rank saw: the all-reduce of the per-layer ``amax`` with MAX. (A layer whose
    calibration saw ``amax = 0`` on some rank has scale 1 there and takes part as such.)

    Args:
        scales: ``{hf_linear_name: 0-dim float32}``; the same names on every rank.
        accelerator: the trainer's ``Accelerator`` (a collective with more than one process).

    Returns:
        A new dict, identical on every rank.

    Raises:
        ValueError: the ranks calibrated different layers.
    """
    names = sorted(scales)
    if accelerator.num_processes == 1:
        return {name: scales[name].detach().float().reshape(()).cpu() for name in names}
    count = torch.tensor([len(names)], device=accelerator.device)
    counts = accelerator.gather(count).cpu()
    if bool((counts != len(names)).any()):
        raise ValueError(f"Ranks calibrated different numbers of NVFP4 layers ({counts.tolist()}); every rank must "
                         "run the same model and layer selection.")
    local = torch.stack([scales[n].detach().float().reshape(()) for n in names]).to(accelerator.device)
    gathered = accelerator.gather(local).view(accelerator.num_processes, len(names)).cpu()
    reduced = gathered.amin(dim=0)
    return {name: reduced[i].clone() for i, name in enumerate(names)}
