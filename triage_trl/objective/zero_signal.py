"""Which completions belong to a zero-signal group (``docs/objective.md``, "Zero-signal groups").

A group whose rewards are all equal carries no policy-gradient update, but TRL's group-normalised
advantage of it, ``(r - mean) / (std + 1e-4)`` in float32, is not exactly 0: eight rewards of 0.35 give
+2.98e-4. The objective is told which groups these are rather than guessing from ``|A|``.
"""

from __future__ import annotations

import torch


def zero_reward_spread(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) bool: True for every completion of a group whose rewards are all equal.

    Groups are ``num_generations`` consecutive completions, as in TRL's GRPO batches. NaN rewards
    (every reward function returned ``None``: TRL leaves them out of the baseline and zeroes their
    advantage) are ignored; a group with no other reward is zero-signal.

    Args:
        rewards: (N,) the rewards the advantages were computed from (TRL's summed ``rewards``), or
            (N, F) per reward function (for ``multi_objective_aggregation="normalize_then_sum"``): the
            group is zero-signal when every column is constant within it.
        num_generations: completions per group (``GRPOConfig.num_generations``).

    Raises:
        ValueError: ``rewards`` is not 1-D or 2-D, or N is not a multiple of ``num_generations``.
    """
    if rewards.dim() not in (1, 2) or num_generations < 1 or rewards.shape[0] % num_generations:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot be cut into groups of num_generations="
            f"{num_generations}: pass the (N,) or (N, F) rewards of whole groups."
        )
    grouped = rewards.reshape(-1, num_generations, 1 if rewards.dim() == 1 else rewards.shape[1])
    missing = torch.isnan(grouped)
    high = grouped.masked_fill(missing, -torch.inf).amax(dim=1)
    low = grouped.masked_fill(missing, torch.inf).amin(dim=1)
    return (high <= low).all(dim=1).repeat_interleave(num_generations)
