"""The sync probe: after a weight sync (the first, then every ``sync_probe_every``-th), the sampler and the learner
score one fixed sequence.

A sampler left with old (or corrupt) weights must never train silently. The probe is
independent of the training batch: a fixed text, tokenised once, scored by the sampler (vLLM's prompt
log-probs) and by the learner (its own forward), both at temperature 1 (``PROBE_TEMPERATURE``). Their mean absolute per-token log-prob
difference is ``triage/sync_probe_gap``.

Telling a stale sampler from precision drift (:func:`classify_probe`): two engines computing the same weights in
different precisions differ by a gap that starts near the floor of :func:`expected_probe_gap` (from what each engine
computes: precisions and dtypes) and then grows slowly as training sharpens the logits (a random tiny model at
lr 0.1: 0.001 -> 0.13 nats in 11 steps). A stale or partial sync instead leaves the sampler where it was while the
learner moved: between two syncs the sampler's log-probs of the probe do not follow the learner's. So the probe
compares the two engines' moves since the previous probe: ``untracked = mean |dL - dS|`` (nats) is the part of the
learner's move the sampler did not make, ``~ mean |dL|`` for a stale sampler and ``~ 0`` for a synced one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Plain text with newlines, digits and common words: every tokenizer splits it into many ordinary tokens.
PROBE_TEXT = (
    "Question: what is 12 + 30?\nLet me think step by step.\n12 + 30 = 42.\n"
    "The quick brown fox jumps over the lazy dog.\nSo the final answer is \\boxed{42}."
)


PROBE_TEMPERATURE = 1.0
"""The temperature both engines score the probe at: vLLM's prompt log-probs are the model's own (temperature 1);
any other would need the full vocabulary's log-probs back per position to rescale."""


class StaleSamplerError(RuntimeError):
    """The sampler does not serve the learner's current weights after a weight sync: stale or partially synced
    (it did not follow the learner's move), corrupt (non-finite log-probs), or computing another model than the
    learner before any update (an architecture or kernel the sync does not reach)."""


# Mean |learner - sampler| probe gap (nats) of two engines holding the same weights, by what they compute.
PROBE_FLOOR_FLOAT32 = 0.02  # both float32, no NVFP4: accumulation order only
PROBE_FLOOR_HALF = 0.1  # bf16 on one side or both (also both NVFP4 weight-only: the same codes)
PROBE_FLOOR_MIXED = 0.5  # NVFP4 weights on one side only (W4A16): the quantisation error itself
PROBE_FLOOR_W4A4 = 2.0
"""NVFP4 with quantised activations (W4A4) on either side: an activation code one engine rounds the other way changes
every later layer's input. Measured on SmolLM2-135M-Instruct's probe (2-core CPUs): 0.5-1.0 nats with both engines
NVFP4 (the demo 0.56, the ``tiny_cpu`` recipe pointed at it 0.64 at the first sync, earlier runs 0.81-0.99) and
0.78-1.18 with NVFP4 on the sampler only (the stability lab's E2b, 100 steps), which a tighter bound stops at the
first sync or reads as a stale sampler later; tiny random models stay under 0.1. A larger model should show less,
and a tighter ``sync_probe_max_gap`` then catches a stale sampler sooner (not measured: nothing here has run on a
GPU)."""
UNTRACKED_SHARE = 0.25  # stale or partial: the sampler missed more than this share of the learner's move
_HALF_DTYPES = ("bfloat16", "float16")


def expected_probe_gap(learner_precision: str, sampler_precision: str, learner_dtype: str,
                       sampler_dtype: str, activations_quantised: bool = True) -> tuple[float, str]:
    """The probe gap (nats) two engines holding the same weights may show, from what each computes.

    Args:
        learner_precision, sampler_precision: ``"bf16"`` or ``"nvfp4"`` (the linear layers' format).
        learner_dtype: the dtype the learner computes in (``"float32"`` for a model TRL loaded from an id, unless
            ``bf16`` autocast or a bf16 ``model_init_kwargs`` dtype).
        sampler_dtype: the engine's dtype (``kernel_report["dtype"]``).
        activations_quantised: whether the NVFP4 layers quantise their inputs (W4A4; ``False``: weight-only).

    Returns:
        ``(bound, why)``: :data:`PROBE_FLOOR_W4A4` with W4A4 NVFP4 on either side, :data:`PROBE_FLOOR_MIXED` with
        weight-only NVFP4 on one side only, :data:`PROBE_FLOOR_FLOAT32` when both compute float32 without NVFP4,
        :data:`PROBE_FLOOR_HALF` otherwise; ``why`` names the case.
    """
    what = (f"learner {learner_precision} computing {learner_dtype}, sampler {sampler_precision} computing "
            f"{sampler_dtype}")
    if "nvfp4" in (learner_precision, sampler_precision) and activations_quantised:
        return PROBE_FLOOR_W4A4, f"{what}, NVFP4 activations quantised (W4A4)"
    if learner_precision != sampler_precision:
        return PROBE_FLOOR_MIXED, what
    if learner_precision != "nvfp4" and learner_dtype == sampler_dtype == "float32":
        return PROBE_FLOOR_FLOAT32, what
    return PROBE_FLOOR_HALF, what


@dataclass(frozen=True)
class ProbeVerdict:
    """What one probe says: ``kind`` is ``"ok"``, ``"drift"`` (above the bound, the sampler followed the learner:
    a warning), or an error kind, ``"corrupt"``, ``"mismatch"`` (above the bound at the first probe, before any
    update) or ``"stale"`` (the sampler did not follow the learner's move); ``message`` explains (empty for ok)."""

    kind: str
    message: str = ""

    @property
    def is_error(self) -> bool:
        return self.kind in ("corrupt", "mismatch", "stale")


def untracked_move(learner_logps: torch.Tensor, sampler_logps: torch.Tensor, prev_learner: torch.Tensor,
                   prev_sampler: torch.Tensor) -> tuple[float, float]:
    """How far the learner's probe log-probs moved since the previous probe, and the part of that move the sampler
    did not make.

    Args:
        learner_logps, sampler_logps: (N,) this probe's log-probs (nats).
        prev_learner, prev_sampler: (N,) the previous probe's.

    Returns:
        ``(moved, untracked)`` in nats: ``mean |dL|`` and ``mean |dL - dS|``.
    """
    d_learner = learner_logps.double().flatten() - prev_learner.double().flatten()
    d_sampler = torch.as_tensor(sampler_logps).double().flatten() - torch.as_tensor(prev_sampler).double().flatten()
    return float(d_learner.abs().mean()), float((d_learner - d_sampler).abs().mean())


def classify_probe(gap: float, bound: float, *, step: int, what: str, first: bool, moved: float | None = None,
                   untracked: float | None = None, rank: int | None = None, step0_gap: float | None = None
                   ) -> ProbeVerdict:
    """Sort one probe gap (nats) into ok, drift or an error (:class:`ProbeVerdict`): non-finite is corrupt; at the
    first probe, above ``bound`` is a mismatch; later, above ``bound``, a sampler that missed more than
    :data:`UNTRACKED_SHARE` of the learner's move (and more than ``bound / 4`` nats) is stale, otherwise it drifted.

    Args:
        gap: mean |learner - sampler| over the probe (``inf`` when non-finite).
        bound: the gap two engines holding the same weights may show (:func:`expected_probe_gap`, or the user's
            ``sync_probe_max_gap``).
        step: the optimizer step of the sync. what: the engines' precisions and dtypes, for the message.
        first: the run's first probe (no update yet): above the bound the two engines compute different models.
        moved, untracked: :func:`untracked_move` against the previous probe (``None`` at the first probe).
        rank: the process whose sampler it is (multi-process runs). step0_gap: the first probe's gap.
    """
    where = f" on rank {rank}" if rank is not None else ""
    head = f"Sync probe at step {step}{where}: the sampler's log-probs of the probe sequence differ from the learner's"
    if not math.isfinite(gap):
        return ProbeVerdict("corrupt", f"{head} by {gap} nats (non-finite): the sampler is corrupt (a bad reload, "
                                       f"e.g. per-tensor loading on the vLLM CPU build; {what}). Check the sampler's "
                                       "sync_weights.")
    if first or moved is None or untracked is None:
        if gap <= bound:
            return ProbeVerdict("ok")
        return ProbeVerdict(
            "mismatch",
            f"{head} by {gap:.4g} nats on average at the run's first sync, before any update (bound {bound:.4g} for "
            f"{what}): the sampler does not compute the model the learner computes. Stale or corrupt sampler weights "
            "(a reload that does not reach every tensor of this architecture), or kernels of another precision. "
            "Check the sampler's sync_weights and kernel report; raise sync_probe_max_gap only if this gap is the "
            "expected precision mismatch.")
    if gap <= bound:  # below it, step-to-step precision noise can exceed a small move (Cohere2: 0.025 of 0.018 nats)
        return ProbeVerdict("ok")
    if untracked > UNTRACKED_SHARE * moved and untracked > bound / 4:
        return ProbeVerdict(
            "stale",
            f"{head} by {gap:.4g} nats on average (bound {bound:.4g} for {what}). The sampler is stale or partially "
            f"synced: since the previous probe the learner's log-probs moved {moved:.4g} nats, and the sampler missed "
            f"{untracked:.4g} of that move (a skipped or partial weight sync). Check the sampler's sync_weights.")
    base = f", {step0_gap:.4g} at the first sync" if step0_gap is not None else ""
    return ProbeVerdict(
        "drift",
        f"{head} by {gap:.4g} nats on average (bound {bound:.4g} for {what}{base}), while the sampler followed the "
        f"learner's move since the previous probe ({untracked:.4g} of {moved:.4g} nats not followed): precision drift "
        "as training sharpens the logits, not a stale sampler. Training continues; triage/sync_probe_gap tracks it.")


def probe_token_ids(tokenizer, min_tokens: int = 8) -> list[int]:
    """Token ids of :data:`PROBE_TEXT` (no special tokens added).

    Raises:
        ValueError: the tokenizer gives fewer than ``min_tokens`` tokens for the probe text.
    """
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if len(ids) < min_tokens:
        raise ValueError(
            f"The sync probe text tokenises to {len(ids)} tokens (< {min_tokens}); the tokenizer cannot score it."
        )
    return list(ids)


def probe_batch(ids: list[int], pad_token_id: int, multiple: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The learner's probe inputs: ``ids`` right-padded to a multiple of ``multiple`` tokens (TRL's
    ``pad_to_multiple_of``, which torchao's native NVFP4 kernels need: the sequence length divisible by 128).

    Right padding leaves every probe token's log-prob unchanged under causal attention, except through a dynamic
    per-tensor activation scale, whose amax also sees the padding rows, as it does in the padded training batches.

    Args:
        ids: the probe's token ids (length L >= 2).
        pad_token_id: the tokenizer's padding token.
        multiple: pad to a multiple of this many tokens; ``None`` pads nothing.

    Returns:
        ``(input_ids, attention_mask, logits_to_keep)``: ``[1, T]`` long tensors (mask 0 on padding) and
        ``T - 1``; the first ``L - 1`` of those ``T - 1`` log-probs are the probe tokens 1..L-1.
    """
    length = len(ids)
    total = length if not multiple else -(-length // multiple) * multiple
    input_ids = torch.full((1, total), int(pad_token_id), dtype=torch.long)
    input_ids[0, :length] = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.zeros((1, total), dtype=torch.long)
    attention_mask[0, :length] = 1
    return input_ids, attention_mask, total - 1


def probe_gap(learner_logps: torch.Tensor, sampler_logps: torch.Tensor) -> tuple[float, float]:
    """Mean and max of ``|learner - sampler|`` over the probe's scored tokens.

    Args:
        learner_logps: (N,) learner log-probs (nats) of probe tokens 1..N.
        sampler_logps: (N,) the sampler's log-probs of the same tokens.

    Returns:
        ``(mean_abs_gap, max_abs_gap)`` in nats; ``(inf, inf)`` when any value is non-finite (a corrupt sampler).

    Raises:
        ValueError: the two have different shapes (the sampler scored a different sequence).
    """
    learner = learner_logps.detach().double().flatten().cpu()
    sampler = torch.as_tensor(sampler_logps).detach().double().flatten().cpu()
    if learner.shape != sampler.shape:
        raise ValueError(
            f"The sampler scored {sampler.numel()} probe tokens but the learner {learner.numel()}: score_logps must "
            "return one log-prob per token after the first."
        )
    diff = (learner - sampler).abs()
    if not bool(torch.isfinite(diff).all()):
        return math.inf, math.inf
    return float(diff.mean()), float(diff.max())
