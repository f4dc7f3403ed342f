"""A plain, per-sequence Python reference of the TRIAGE objective (steps 1-9 of docs/objective.md).

Loops over sequences and tokens, Python floats, no torch. Inputs are float32 on the torch side, so
the reference rounds the gap and the thresholds it compares against to float32 (as torch does when
it compares a float32 tensor with a Python number); every count, mass and ratio is exact Python.
"""

from __future__ import annotations

import math

import numpy as np

QUADRANTS = ("NA", "PA", "NC", "PC")


def f32(x: float) -> float:
    return float(np.float32(x))


def reference_segment_ids(token_ids, mode, max_tokens, newline_ids):
    out = []
    for row in token_ids:
        ids, seg, length = [], 0, 0
        for t, tok in enumerate(row):
            if mode == "fixed":
                ids.append(t // max_tokens)
                continue
            ids.append(seg)
            length += 1
            if tok in newline_ids or length == max_tokens:
                seg, length = seg + 1, 0
        out.append(ids)
    return out


class ReferenceSamplerBroken(Exception):
    """The reference's counterpart of NonFiniteSamplerLogprobsError."""


def reference_triage(old, sampler, adv, mask, seg_ids, cfg, zero_signal=None):
    """Returns (weights as nested lists, metrics dict). `adv` is per sequence (list) or per token.

    Raises ReferenceSamplerBroken when too many valid tokens have a non-finite sampler log-prob.
    """
    B = len(old)
    T = len(old[0]) if B else 0
    zero_signal = [bool(z) for z in zero_signal] if zero_signal is not None else [False] * B
    per_token_adv = B > 0 and isinstance(adv[0], (list, tuple))
    A = [[float(adv[b][t]) if per_token_adv else float(adv[b]) for t in range(T)] for b in range(B)]
    valid = [[bool(mask[b][t]) for t in range(T)] for b in range(B)]
    measured = [[valid[b][t] and math.isfinite(sampler[b][t]) for t in range(T)] for b in range(B)]
    nonfinite = [[valid[b][t] and not math.isfinite(sampler[b][t]) for t in range(T)] for b in range(B)]
    # diagnosed: measured tokens of completions whose group had reward spread
    diag = [[measured[b][t] and not zero_signal[b] for t in range(T)] for b in range(B)]
    n_valid = sum(map(sum, valid))
    n_nonfinite = sum(map(sum, nonfinite))
    if n_nonfinite > cfg.triage_nonfinite_max_frac * n_valid:
        raise ReferenceSamplerBroken(n_nonfinite, n_valid)
    gap = [
        [float(np.float32(old[b][t]) - np.float32(sampler[b][t])) if measured[b][t] else 0.0 for t in range(T)]
        for b in range(B)
    ]

    def sign(x):
        return (x > 0) - (x < 0)

    quad = [[None] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            a, g = sign(A[b][t]), sign(gap[b][t]) * cfg.triage_gap_sign
            if not diag[b][t] or a == 0 or g == 0:
                continue
            quad[b][t] = ("N" if a < 0 else "P") + ("A" if a == g else "C")

    abs_values = sorted(abs(gap[b][t]) for b in range(B) for t in range(T) if diag[b][t])
    tau = cfg.triage_tail_min_gap
    if abs_values:
        k = min(len(abs_values), max(1, math.ceil(cfg.triage_tail_quantile * len(abs_values))))
        tau = max(tau, abs_values[k - 1])
    tail = [[diag[b][t] and abs(gap[b][t]) >= f32(tau) for t in range(T)] for b in range(B)]
    amp_tail = [[tail[b][t] and quad[b][t] in ("NA", "PA") for t in range(T)] for b in range(B)]

    segments = {}  # (b, s) -> [n diagnosed tokens, k amplifying tail tokens]
    for b in range(B):
        for t in range(T):
            n_k = segments.setdefault((b, seg_ids[b][t]), [0, 0])
            n_k[0] += diag[b][t]
            n_k[1] += amp_tail[b][t]
    hot = {
        key: k >= cfg.triage_hot_min_tokens and (k / n if n else 0.0) >= cfg.triage_hot_density
        for key, (n, k) in segments.items()
    }
    in_hot = [[valid[b][t] and hot[(b, seg_ids[b][t])] for t in range(T)] for b in range(B)]

    mass = {"NA": 0.0, "PA": 0.0}
    for b in range(B):
        for t in range(T):
            if in_hot[b][t] and quad[b][t] in mass:
                mass[quad[b][t]] += abs(A[b][t])
    heavy = "NA" if mass["NA"] >= mass["PA"] else "PA"
    light = "PA" if heavy == "NA" else "NA"
    beta = 1.0
    if mass[heavy] > 0:
        beta = min(1.0, max(cfg.triage_rebalance_floor, mass[light] / mass[heavy]))

    weights = [[1.0] * T for _ in range(B)]
    rebalanced = [[False] * T for _ in range(B)]
    severe = [[False] * T for _ in range(B)]
    C = cfg.triage_repair_clip
    for b in range(B):
        for t in range(T):
            if not valid[b][t]:
                continue
            if nonfinite[b][t]:
                weights[b][t] = 0.0  # unmeasured: no update, in every repair mode
                continue
            w = 1.0
            if beta < 1.0 and in_hot[b][t] and quad[b][t] == heavy:
                if cfg.triage_rebalance_scope == "segment" or tail[b][t]:
                    w, rebalanced[b][t] = beta, True
            is_severe = diag[b][t] and A[b][t] != 0 and abs(gap[b][t]) >= f32(cfg.triage_severe_gap)
            if is_severe and cfg.triage_repair_mode != "none":
                severe[b][t] = True
                if cfg.triage_repair_mode == "mask":
                    w = 0.0
                else:
                    g = gap[b][t]
                    w *= min(C, max(1.0 / C, math.exp(sign(g) * (abs(g) - cfg.triage_severe_gap))))
            weights[b][t] = w

    n_meas = sum(map(sum, measured))
    n_diag = sum(map(sum, diag))
    dv, dm, dd = max(n_valid, 1), max(n_meas, 1), max(n_diag, 1)
    m = {}
    cells = [(b, t) for b in range(B) for t in range(T)]
    # mismatch metrics: every measured token, zero-signal groups included (gap is 0 elsewhere)
    m["gap_mean"] = sum(gap[b][t] for b, t in cells) / dm
    m["gap_abs_mean"] = sum(abs(gap[b][t]) for b, t in cells) / dm
    m["gap_abs_max"] = max((abs(gap[b][t]) for b, t in cells), default=0.0)
    m["k3_kl"] = sum(math.expm1(min(gap[b][t], 80.0)) - gap[b][t] for b, t in cells if measured[b][t]) / dm
    # verl's sign: mean sampler log-prob - mean learner log-prob per sequence = log PPL(learner) - log PPL(sampler)
    seq_means = [-sum(gap[b]) / sum(measured[b]) for b in range(B) if sum(measured[b]) > 0]
    m["log_ppl_diff"] = sum(seq_means) / len(seq_means) if seq_means else 0.0
    m["nonfinite_sampler_frac"] = n_nonfinite / dv
    for q in QUADRANTS:
        m[f"frac_{q}"] = sum(quad[b][t] == q for b, t in cells) / dd
    for q in QUADRANTS:
        m[f"tail_count_{q}"] = float(sum(quad[b][t] == q and tail[b][t] for b, t in cells))
    m["amp_imbalance"] = m["tail_count_NA"] / (m["tail_count_PA"] + 1.0)
    nonempty = [key for key, (n, _) in segments.items() if n > 0]
    m["hot_segment_frac"] = sum(hot[key] for key in nonempty) / max(len(nonempty), 1)
    total_amp_tail = sum(map(sum, amp_tail))
    m["tail_in_hot_frac"] = sum(amp_tail[b][t] and in_hot[b][t] for b, t in cells) / max(total_amp_tail, 1)
    if total_amp_tail == 0:
        m["tail_concentration"] = 0.0
    else:
        top = math.ceil(len(nonempty) / 10)
        counts = sorted((segments[key][1] for key in nonempty), reverse=True)
        m["tail_concentration"] = sum(counts[:top]) / total_amp_tail
    m["beta"] = beta
    m["rebalanced_frac"] = sum(map(sum, rebalanced)) / dd
    m["repaired_frac"] = sum(map(sum, severe)) / dd
    valid_weights = [weights[b][t] for b, t in cells if valid[b][t]]
    m["weight_mean"] = sum(valid_weights) / dv if valid_weights else 1.0
    m["weight_min"] = min(valid_weights, default=1.0)
    m["weight_max"] = max(valid_weights, default=1.0)
    m["tau"] = tau
    return weights, m


def random_objective_batch(B: int, T: int, seed: int, gap_scale: float):
    """A random micro-batch for the objective's tests: ``(old_logps, sampler_logps, advantages, mask, segments)``,
    learner log-probs in [-3, 0], sampler = learner + N(0, gap_scale) nats, random lengths, 8-token segments."""
    import torch

    from triage_trl import segment_ids

    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    sampler = old + torch.randn(B, T, generator=g) * gap_scale
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    seg = segment_ids(torch.zeros(B, T, dtype=torch.long), mode="fixed", max_tokens=8)
    return old, sampler, adv, mask, seg
