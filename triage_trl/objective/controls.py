"""Controls of the TRIAGE objective: weightings that keep part of TRIAGE and drop the rest (``docs/objective.md``,
"Direction-blind control"). They are experiments' arms, not objectives to train with.

:func:`direction_blind_weights` keeps the tokens TRIAGE reweights and TRIAGE's mean weight, and drops the direction
(which quadrant, which sign of the gap): every touched token gets the same weight. If the direction matters, TRIAGE
and this control differ; if only "touch the mismatched tokens, by this much" matters, they do not.
"""

from __future__ import annotations

import torch


def touched_tokens(
    diagnosed_f: torch.Tensor,
    advantages: torch.Tensor,
    in_hot: torch.Tensor | None,
    tail: torch.Tensor,
    rebalanced: bool,
    scope: str,
    severe: torch.Tensor | None,
) -> torch.Tensor:
    """(B, T) bool: the tokens TRIAGE reweights, any quadrant.

    The rebalancing region (only when TRIAGE rebalanced this micro-batch, ``beta < 1``): diagnosed tokens with a
    non-zero advantage in hot segments (``scope="tail"``: only their tail tokens), whatever their quadrant, where
    TRIAGE touches those of the heavier amplifying quadrant. The repair region: step 7's severe tokens (``None``:
    none). Tokens with a zero advantage carry no policy-gradient update, so they take no share of the weight.

    Args:
        diagnosed_f: (B, T) float32 0/1, the diagnosed tokens (measured, in a group with reward spread).
        advantages: (B, 1) or (B, T), 0 in zero-signal rows.
        in_hot: (B, T) bool positions of hot segments, or ``None`` when no segment is hot.
        tail: (B, T) bool tail tokens (``|gap| >= tau``).
        rebalanced: whether step 6 applied a ``beta < 1``.
        scope: ``triage_rebalance_scope`` (``"segment"`` or ``"tail"``).
        severe: (B, T) bool repaired tokens, or ``None``.
    """
    touched = torch.zeros(diagnosed_f.shape, dtype=torch.bool, device=diagnosed_f.device)
    if rebalanced and in_hot is not None:
        region = in_hot & (diagnosed_f > 0) & (advantages != 0)
        touched |= region & tail if scope == "tail" else region
    if severe is not None:
        touched |= severe
    return touched


def direction_blind_weights(weights: torch.Tensor, touched: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The direction-blind control: each touched token gets the mean of ``weights`` over the touched tokens.

    The other tokens keep their weight, so the sum (and the mean over valid tokens) of the weights is TRIAGE's, up
    to float32 rounding of the common weight; the weights TRIAGE moved are spread evenly over the tokens it touched.

    Args:
        weights: (B, T) float32, TRIAGE's ``full`` weights (1 on every token outside ``touched`` except unmeasured
            ones, which are 0 and must not be touched).
        touched: (B, T) bool, from :func:`touched_tokens`.

    Returns:
        ``(blind_weights, common)``: (B, T) float32 weights and the common weight (1.0 when nothing is touched).
    """
    count = int(torch.count_nonzero(touched))
    if count == 0:
        return weights, 1.0
    common = float((weights * touched).sum(dtype=torch.float64)) / count
    return torch.where(touched, torch.tensor(common, dtype=weights.dtype, device=weights.device), weights), common
