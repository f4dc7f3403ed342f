"""Which completions belong to a group with zero reward spread (no learning signal), from the rewards themselves.

TRL's group-normalised advantage of a group whose rewards are all equal is not exactly 0 in floating point (eight
rewards of 0.35 give +2.98e-4), so TRIAGE must not guess "no signal" from |A|: the trainer computes it here from the
rewards TRL scored and passes it to the objective (``docs/objective.md``, "Zero-signal groups").
"""

from __future__ import annotations

import torch


def zero_signal_completions(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    num_generations: int,
    multi_objective_aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Mark every completion whose group's rewards carry no learning signal.

    Args:
        rewards_per_func: (N, F) rewards of N completions (groups of ``num_generations`` consecutive rows, as TRL
            orders them) under F reward functions; NaN where a function did not score a completion.
        reward_weights: (F,) TRL's ``reward_weights``.
        num_generations: completions per prompt; must divide N.
        multi_objective_aggregation: TRL's setting. ``"sum_then_normalize"``: a group has no signal when its weighted
            reward sums are all equal. ``"normalize_then_sum"``: when every function's rewards are equal within the
            group (each function is normalised on its own first).

    Returns:
        (N,) bool: True for every completion of a zero-signal group. A completion no function scored (all NaN) is
        ignored in its group's comparison; a group with no scored completion has no signal.

    Raises:
        ValueError: N is not a multiple of ``num_generations``, or an unknown aggregation.
    """
    n, num_funcs = rewards_per_func.shape
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"{n} completions do not split into groups of num_generations={num_generations}.")
    if multi_objective_aggregation == "sum_then_normalize":
        unscored = torch.isnan(rewards_per_func).all(dim=1, keepdim=True)
        summed = (rewards_per_func * reward_weights.to(rewards_per_func)).nansum(dim=1, keepdim=True)
        columns = summed.masked_fill(unscored, float("nan"))
    elif multi_objective_aggregation == "normalize_then_sum":
        columns = rewards_per_func
    else:
        raise ValueError(f"Unknown multi_objective_aggregation {multi_objective_aggregation!r}.")
    grouped = columns.view(n // num_generations, num_generations, -1)
    scored = ~torch.isnan(grouped)
    high = grouped.masked_fill(~scored, float("-inf")).amax(dim=1)
    low = grouped.masked_fill(~scored, float("inf")).amin(dim=1)
    # A column with no scored value in the group gives high = -inf < low = +inf: no spread either.
    no_spread = (high <= low).all(dim=1)
    return no_spread.repeat_interleave(num_generations)
