"""E1, the mechanism test (``docs/stability.md``, "E1: the mechanism"): the arms and the measurements, as pure
functions. The driver is ``benchmarks/mechanism_e1.py``.

From one saved state (model, optimizer, a rollout batch of a naive NVFP4 run) each arm takes one optimizer step
with its own objective; both engines then re-score the same completions. An arm is a lab configuration
(:data:`ARMS`); only its objective fields (:data:`OBJECTIVE_FIELDS`) differ between arms, so the precisions, the
dose and the optimizer are the same for all.
"""

from __future__ import annotations

import math

import torch

from ..objective.order_statistic import kth_smallest, order_statistic_rank
from ..objective.steps import QUADRANTS, direction_quadrants, measure_gap
from ..objective.config import TriageConfig
from .metrics import paired_bootstrap  # noqa: F401  (re-exported: E1's paired intervals)
from .null_models import permute_within_groups  # noqa: F401  (re-exported: E1's null arm)

ARMS: dict[str, str] = {
    "naive": "nvfp4_naive",
    "tis": "nvfp4_tis",
    "opsm": "nvfp4_opsm",
    "triage": "triage",
    "rebalance_only": "triage_no_repair",
    "repair_only": "triage_no_rebalance",
    "direction_blind": "direction_blind",
    "naive_permuted": "nvfp4_naive",
}
"""E1's arms -> the lab configuration (:mod:`triage_trl.lab.configs`) whose objective each arm applies. ``naive``
comes first: its step also advances the run. ``naive_permuted`` is the null model of the quadrant changes
(:data:`PERMUTED_ARMS`)."""

PERMUTED_ARMS = frozenset({"naive_permuted"})
"""Arms that take naive's step with the batch's advantages permuted among the completions of each group
(:func:`permute_within_groups`): the same step size and reward spread, with no link between a completion's
advantage and its tokens' gaps. The quadrants stay those of the true advantages. Quadrants are selected by the sign
of the gap before the step, so under any step that moves the sampler's 4-bit rounding their mean gaps regress toward
0; this arm measures that regression, and ``naive - naive_permuted`` on the NA gap is the mechanism's own effect
(a reconstruction: the paper's abstract gives no such control)."""

OBJECTIVE_FIELDS = (
    *TriageConfig.__dataclass_fields__,
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "off_policy_mask_threshold",
)
"""The ``TriageGRPOConfig`` fields that make an arm's objective (everything else is the naive run's)."""

MEASURES = ("k3", "gap_mean", "p99_abs_gap", *(f"gap_{q}" for q in QUADRANTS), "heldout_ll", "learner_move",
            "sampler_move")
"""Per (batch, arm), each as ``after - before``: k3 = mean(e^gap - 1 - gap) and the mean gap over the batch's
valid tokens (learner - sampler, nats/token), the 99th percentile of |gap| (nats), the mean gap over the tokens of
each quadrant (fixed by the advantage and the gap before the step), the mean teacher-forced log-likelihood of
the reference answers of held-out items (nats/token, learner), and how far each engine's log-probs of the batch's
tokens moved (:func:`engine_moves`; their difference is ``gap_mean``'s change)."""

_K3_MAX_EXPONENT = 80.0


def mismatch_stats(learner: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor,
                   quadrants: dict[str, torch.Tensor]) -> dict[str, float]:
    """Learner-sampler mismatch of one batch of completions.

    Args:
        learner, sampler: (B, T) log-probs (nats) of the same tokens by the two engines; a non-finite sampler
            value leaves its token out.
        mask: (B, T) bool/0-1 completion mask.
        quadrants: ``{"NA", "PA", "NC", "PC"}`` -> (B, T) bool token sets (:func:`batch_quadrants`).

    Returns:
        ``k3``, ``gap_mean`` (nats/token over measured tokens), ``p99_abs_gap`` (nats, exact order statistic,
        numpy's ``inverted_cdf``), ``gap_<Q>`` (mean gap over the measured tokens of quadrant Q; NaN when empty) and
        ``n_<Q>`` token counts.
    """
    valid = mask.bool() if mask.dtype != torch.bool else mask
    gap = measure_gap(learner.detach().float(), sampler.detach().float(), valid)
    measured = gap.measured
    n = int(torch.count_nonzero(measured))
    values = gap.gap[measured].double()
    out = {
        "k3": float((torch.expm1(values.clamp(max=_K3_MAX_EXPONENT)) - values).mean()) if n else math.nan,
        "gap_mean": float(values.mean()) if n else math.nan,
        "p99_abs_gap": kth_smallest(gap.abs_gap[measured], order_statistic_rank(n, 0.99)) if n else math.nan,
    }
    for q in QUADRANTS:
        tokens = quadrants[q] & measured
        count = int(torch.count_nonzero(tokens))
        out[f"gap_{q}"] = float(gap.gap[tokens].double().mean()) if count else math.nan
        out[f"n_{q}"] = count
    return out


def engine_moves(learner_before: torch.Tensor, sampler_before: torch.Tensor, learner_after: torch.Tensor,
                 sampler_after: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far each engine moved on the batch's tokens over one step: the mean of ``after - before`` of its
    log-probs (nats/token) over the tokens both engines measured at both times.

    A gap can widen because the learner moves and the sampler does not follow (a sync that loses the update, e.g. a
    LoRA delta below the NVFP4 rounding step of the merged weight, ``docs/nvfp4.md`` "LoRA adapters"), or because
    both move differently; ``learner_move`` and ``sampler_move`` tell the two apart.

    Args:
        learner_before, sampler_before, learner_after, sampler_after: (B, T) log-probs (nats); non-finite values
            leave their token out.
        mask: (B, T) bool/0-1 completion mask.

    Returns:
        ``learner_move`` and ``sampler_move`` (nats/token; NaN when no token is measured).
    """
    tensors = [t.detach().double() for t in (learner_before, sampler_before, learner_after, sampler_after)]
    valid = mask.bool() if mask.dtype != torch.bool else mask
    for t in tensors:
        valid = valid & torch.isfinite(t)
    if not bool(valid.any()):
        return {"learner_move": math.nan, "sampler_move": math.nan}
    lb, sb, la, sa = (t[valid] for t in tensors)
    return {"learner_move": float((la - lb).mean()), "sampler_move": float((sa - sb).mean())}


def batch_quadrants(learner: torch.Tensor, sampler: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    zero_signal: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """TRIAGE's quadrants (``docs/objective.md``, step 2) of a batch, from the gap before the step.

    Args:
        learner, sampler: (B, T) log-probs (nats); advantages: (B,) or (B, T); mask: (B, T).
        zero_signal: optional (B,) bool: completions of groups without reward spread join no quadrant.
    """
    valid = mask.bool() if mask.dtype != torch.bool else mask
    gap = measure_gap(learner.detach().float(), sampler.detach().float(), valid)
    adv = advantages.detach().float()
    adv = adv[:, None] if adv.dim() == 1 else adv
    if zero_signal is not None:
        adv = adv * (~zero_signal).float()[:, None]
    return direction_quadrants(gap.gap, adv, 1)


def trl_importance_ratio(old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                         clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio, as ``GRPOTrainer._generate_and_score_completions`` computes it
    (the generation batch keeps only the run's own; an arm with another correction needs its own).

    Args:
        old_logps, sampler_logps: (B, T) learner and sampler log-probs (nats); NaN differences count as 0.
        mask: (B, T) completion mask; mode: ``vllm_importance_sampling_mode``; clip_min, clip_max: its bounds.

    Returns:
        (B, T) for ``token_*`` modes, (B, 1) for ``sequence_*`` modes.

    Raises:
        ValueError: an unknown mode.
    """
    diff = torch.nan_to_num((old_logps - sampler_logps) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        low = clip_min if clip_min is not None else -math.inf
        high = clip_max if clip_max is not None else math.inf
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"Unknown vllm_importance_sampling_mode {mode!r}: use token_truncate, token_mask, "
                     "sequence_truncate or sequence_mask.")
