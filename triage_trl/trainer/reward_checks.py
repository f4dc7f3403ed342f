"""Rewards that would train silently on nothing stop the run, naming the reward function.

TRL 1.16's ``GRPOTrainer._calculate_rewards`` returns the ``(N, F)`` rewards of every process's completions (``N``
completions, ``F`` reward functions; ``None`` becomes NaN) and its advantages sum them with ``nansum``: a completion
no function scored gets reward 0, ``inf`` makes its group's advantages NaN and rewards of 1e38 overflow the float32
standard deviation, and each case gives loss 0 and gradient 0 without an error. :func:`check_rewards` refuses:

* ``+inf``/``-inf`` from any function, for any completion;
* a batch in which no completion has a finite reward from any function (e.g. the only function returns NaN or
  ``None`` for every item); a batch where only some completions lack one trains as in TRL (TRL warns, those score 0)
  and the share is logged as ``triage/reward_missing_frac``;
* finite rewards whose weighted sum or standard deviation (per group, over the batch, per function; TRL's
  ``nanstd``, which squares the deviations in float32) overflows: ``|r|`` above about 1e19.

It runs on the gathered rewards, so every process stops at the same step. Works with every launch configuration
(single process, DDP, FSDP2, ZeRO).
"""

from __future__ import annotations

import torch


class NonFiniteRewardError(ValueError):
    """A reward function gave rewards the advantages cannot be computed from; the message names it and the fix."""


def _name(names, f: int) -> str:
    return names[f] if names and f < len(names) else f"#{f}"


def check_rewards(rewards_per_func: torch.Tensor, *, names=None, weights: torch.Tensor | None = None,
                  num_generations: int | None = None, step: int | None = None) -> float:
    """Check a batch's rewards before TRL turns them into advantages.

    Args:
        rewards_per_func: ``(N, F)`` rewards, NaN where a function returned ``None`` (or NaN).
        names: the ``F`` reward functions' names (``GRPOTrainer.reward_func_names``).
        weights: ``(F,)`` reward weights (default ones).
        num_generations: completions per group (``N`` divisible by it); default one group.
        step: the global step, for the message.

    Returns:
        The share of completions without any finite reward (in [0, 1)).

    Raises:
        NonFiniteRewardError: an infinite reward; no finite reward in the whole batch; an overflowing sum or standard
            deviation. The message names the function(s), the count and the fix.
    """
    at = f" at step {step}" if step is not None else ""
    rewards = rewards_per_func.detach().float().cpu()
    n, f = rewards.shape
    infinite = torch.isinf(rewards)
    for j in range(f):
        count = int(infinite[:, j].sum())
        if count:
            raise NonFiniteRewardError(
                f"Reward function {_name(names, j)} returned an infinite reward for {count} of {n} completions{at}: "
                "return finite floats (clip or map failures to a finite value), or None for a completion it does not "
                "score."
            )
    missing = torch.isnan(rewards).all(dim=1)
    if n and bool(missing.all()):
        all_nan = [_name(names, j) for j in range(f) if bool(torch.isnan(rewards[:, j]).all())]
        raise NonFiniteRewardError(
            f"No completion of this batch{at} has a finite reward: reward function(s) {', '.join(all_nan)} returned "
            f"NaN or None for all {n} completions, so every advantage is 0 and the model learns nothing. Return a "
            "float for each completion (None only for those a function does not score, with another function scoring "
            "them)."
        )
    from trl.trainer.utils import nanstd  # the standard deviation TRL's advantages and reward metrics use

    w = torch.ones(f) if weights is None else weights.detach().float().cpu()
    summed = (rewards * w).nansum(dim=1)
    groups = summed.view(-1, num_generations) if num_generations and n % num_generations == 0 else summed[None]
    stds = [nanstd(groups, dim=1), nanstd(summed)[None], *(nanstd(rewards[:, j])[None] for j in range(f))]
    if n > 1 and not (torch.isfinite(summed).all() and all(torch.isfinite(s[~torch.isnan(s)]).all() for s in stds)):
        peak = rewards.nan_to_num(0.0).abs().amax(dim=0)
        culprit = _name(names, int(peak.argmax()))
        raise NonFiniteRewardError(
            f"The rewards{at} overflow float32 when their sum or standard deviation is computed (reward "
            f"function {culprit} returned |r| up to {float(peak.max()):.3g}): rescale that function's rewards (e.g. "
            "to [0, 1]) or lower its reward weight."
        )
    return float(missing.float().mean()) if n else 0.0
