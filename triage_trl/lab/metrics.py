"""The stability lab's per-run numbers and their stated rules (pure Python: no torch, no numpy).

Each rule is a constant below; :func:`rules_text` prints them under the results table.
"""

from __future__ import annotations

import math
import statistics

from ..runtime.run_logs import log_series

SPIKE_FACTOR = 3.0
"""A grad-norm spike: ``grad_norm`` above ``SPIKE_FACTOR`` x the median of the run's previous steps' grad norms..."""
SPIKE_MIN_HISTORY = 3
"""...counted only from the step that has at least this many previous steps (a non-finite grad norm is a spike)."""
COLLAPSE_RATIO = 0.5
"""A run collapsed when it failed, or logged a non-finite reward / loss / grad norm, or its final held-out accuracy
is <= ``COLLAPSE_RATIO`` x its step-0 accuracy (this last test only when the step-0 accuracy is > 0)."""
FINITE_KEYS = ("reward", "loss", "grad_norm")
"""Log keys whose non-finite values mark a run as non-finite."""


def rules_text() -> list[str]:
    """The rules as markdown bullet lines."""
    return [
        f"- **grad-norm spike**: a step whose `grad_norm` is > {SPIKE_FACTOR:g} x the median `grad_norm` of the run's "
        f"previous steps, counted from the step with at least {SPIKE_MIN_HISTORY} previous steps; a non-finite "
        "grad norm is a spike.",
        "- **collapsed (acc. rule)**, the earlier rounds' rule: the run failed (raised), or logged a non-finite "
        f"{' / '.join(FINITE_KEYS)}, or its final "
        f"held-out accuracy is <= {COLLAPSE_RATIO:g} x its step-0 accuracy (only when step-0 accuracy > 0).",
        "- **reward AUC**: normalised area under the training-reward curve = the mean over the optimizer steps "
        "that generated (every step, or every `num_iterations`-th) of the step's mean reward (weighted sum: 1.0 x "
        "accuracy + 0.2 x answer-then-stop, so in [0, 1.2]).",
        "- **held-out accuracy**: greedy, the run's own sampler synced to the learner; *final* at the last step, "
        "*best* over every evaluation including step 0; a failed run keeps its last evaluation.",
        "- **k3 KL**: `triage/k3_kl` = mean over tokens of e^gap - 1 - gap, gap = learner - sampler log-prob "
        "(nats/token), at the optimizer steps that generated (with several updates per rollout a later update's "
        "batch k3 also holds the learner's own move); *max* over those steps and *final* (the last).",
        "- mean ± std over seeds: sample standard deviation (n - 1); with one seed only the mean is shown.",
    ]


def training_records(history: list[dict]) -> list[dict]:
    """The per-step training records of a log history (those with a ``reward``), in step order."""
    return sorted((h for h in history if "reward" in h and "step" in h), key=lambda h: h["step"])


def every_step_series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over every record that logged it with a step (e.g. the grad norm, logged at
    every optimizer step, where rewards and k3 come only with the steps that generated), in step order."""
    records = sorted((h for h in history if key in h and "step" in h), key=lambda h: h["step"])
    return [h["step"] for h in records], [float(h[key]) for h in records]


def step_series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over the training records (non-finite values kept)."""
    return log_series(training_records(history), key, finite=False)


def count_spikes(grad_norms: list[float], factor: float = SPIKE_FACTOR, min_history: int = SPIKE_MIN_HISTORY) -> int:
    """Grad-norm spikes of one run (rule: :data:`SPIKE_FACTOR`, :data:`SPIKE_MIN_HISTORY`).

    Args:
        grad_norms: one grad norm per optimizer step, in order.
    """
    spikes = 0
    for i, value in enumerate(grad_norms):
        if not math.isfinite(value):
            spikes += 1
            continue
        previous = [g for g in grad_norms[:i] if math.isfinite(g)]
        if i >= min_history and previous and value > factor * statistics.median(previous):
            spikes += 1
    return spikes


def reward_auc(rewards: list[float]) -> float:
    """Normalised area under the reward curve: the mean of the per-step mean rewards (NaN when none)."""
    return sum(rewards) / len(rewards) if rewards else math.nan


def is_non_finite(history: list[dict]) -> bool:
    """Whether any training record has a non-finite :data:`FINITE_KEYS` value."""
    return any(isinstance(h.get(k), (int, float)) and not math.isfinite(h[k])
               for h in training_records(history) for k in FINITE_KEYS)


def collapsed(status: str, history: list[dict], held_out: list[dict], ratio: float = COLLAPSE_RATIO) -> bool:
    """The collapse rule (:data:`COLLAPSE_RATIO`) for one run.

    Args:
        status: the run's ``status`` (``"ok"`` or ``"failed: ..."``).
        held_out: evaluation records ``{"step", "accuracy"}`` in order (step 0 first).
    """
    if status != "ok" or is_non_finite(history):
        return True
    if not held_out:
        return False
    first, last = held_out[0]["accuracy"], held_out[-1]["accuracy"]
    return first > 0 and last <= ratio * first


def run_metrics(summary: dict, history: list[dict]) -> dict:
    """The table's numbers for one run, from its ``run_summary.json`` and log history.

    Returns:
        ``final_acc``, ``best_acc``, ``step0_acc`` (NaN when there is no evaluation), ``reward_auc``, ``k3_first``,
        ``k3_mean``, ``k3_max``, ``k3_final`` (nats/token over the optimizer steps; NaN when not logged), ``spikes``,
        ``collapsed``, ``failed``, ``non_finite``, ``wall_min``, ``steps`` (optimizer steps logged), ``rollouts``
        (steps that generated, i.e. logged a reward: ``steps / num_iterations``).
    """
    held_out = summary.get("held_out") or []
    accuracies = [r["accuracy"] for r in held_out]
    _, rewards = step_series(history, "reward")
    _, k3 = step_series(history, "triage/k3_kl")
    k3_finite = [v for v in k3 if math.isfinite(v)]
    _, grad_norms = every_step_series(history, "grad_norm")
    status = summary.get("status", "missing")
    return {
        "step0_acc": accuracies[0] if accuracies else math.nan,
        "final_acc": accuracies[-1] if accuracies else math.nan,
        "best_acc": max(accuracies) if accuracies else math.nan,
        "reward_auc": reward_auc(rewards),
        "k3_first": k3[0] if k3 else math.nan,
        "k3_mean": sum(k3_finite) / len(k3_finite) if k3_finite else math.nan,
        "k3_max": max(k3_finite) if k3_finite else math.nan,
        "k3_final": k3[-1] if k3 else math.nan,
        "spikes": count_spikes(grad_norms),
        "collapsed": collapsed(status, history, held_out),
        "failed": status != "ok",
        "non_finite": is_non_finite(history),
        "wall_min": summary.get("wall_seconds", math.nan) / 60.0,
        "steps": len(grad_norms) or len(rewards),
        "rollouts": len(rewards),
    }


def mean_std(values: list[float]) -> tuple[float, float, int]:
    """``(mean, sample std, n)`` over the finite values; std is NaN for n < 2, both NaN for n = 0."""
    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, 0
    mean = sum(finite) / len(finite)
    std = statistics.stdev(finite) if len(finite) > 1 else math.nan
    return mean, std, len(finite)


def format_mean_std(values: list[float], fmt: str = ".3f") -> str:
    """``"m ± s"`` (``"m"`` for one value, ``"n/a"`` for none), in format ``fmt``."""
    mean, std, n = mean_std(values)
    if n == 0:
        return "n/a"
    if n == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ± {format(std, fmt)}"


WEIGHT_KEY = "triage/weight_mean"
"""The logged mean TRIAGE weight over a step's valid tokens (in diagnose mode: what full mode would apply)."""


def mean_triage_weight(history: list[dict]) -> float:
    """The effective-step control's learning-rate scale: the mean over training steps of ``triage/weight_mean``.

    Each step's value is the mean TRIAGE weight over that step's valid tokens (the trainer's ``triage/weight_mean``),
    so the product with the learning rate is, step by step on average, the size of TRIAGE's policy-gradient step
    relative to naive's (the weights multiply the per-token loss before TRL's token-mean aggregation).

    Raises:
        ValueError: no training step logged a finite ``triage/weight_mean`` (the run has not trained).
    """
    _, values = step_series(history, WEIGHT_KEY)
    values = [v for v in values if math.isfinite(v)]
    if not values:
        raise ValueError(f"The run logged no finite {WEIGHT_KEY!r} on a training step: it has not trained. Run it "
                         "to the end first.")
    return statistics.fmean(values)


# ---------------------------------------------------------------- cost / gain / stability (pre-registered rules)

COLLAPSE_REWARD_WINDOW = 10
"""Pre-registered collapse rule (docs/stability.md, "Pre-registered collapse rule"), part 1: the moving mean of the
training reward over this many steps..."""
COLLAPSE_REWARD_DROP = 0.2
"""...falls at least this far below its running peak and is still that far below it at the last step."""
COLLAPSE_K3_FACTOR = 5.0
"""Part 2: a step's learner-sampler k3 is >= this x the mean k3 of the first ``COLLAPSE_K3_BASELINE_STEPS`` steps."""
COLLAPSE_K3_BASELINE_STEPS = 10
"""The steps whose mean k3 is the baseline of part 2 (k3 is judged only from the step after them)."""


def paired_bootstrap(differences: list[float], *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """Mean of paired differences with a percentile bootstrap interval (resampling the pairs).

    Args:
        differences: one value per pair (per batch, per (seed, item), ...); NaNs are dropped.
        n_boot: bootstrap resamples; level: interval coverage; seed: resampling seed (reproducible).

    Returns:
        ``{"mean", "low", "high", "n"}``; ``low``/``high`` are NaN with fewer than 2 pairs.
    """
    import random

    values = [v for v in differences if not math.isnan(v)]
    n = len(values)
    if n == 0:
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": n}
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(n_boot))
    tail = (1.0 - level) / 2.0
    low = means[min(n_boot - 1, int(math.floor(tail * n_boot)))]
    high = means[min(n_boot - 1, int(math.ceil((1.0 - tail) * n_boot)) - 1)]
    return {"mean": mean, "low": low, "high": high, "n": n}


def step0_cost(step0_accuracy: float, reference_step0_accuracy: float) -> float:
    """The quantisation's step-0 cost: the reference's (bf16's) held-out accuracy at step 0 minus the run's, before
    any update (no objective can change it)."""
    return reference_step0_accuracy - step0_accuracy


def training_gain(step0_correct: list[list[int]], final_correct: list[list[int]], **bootstrap) -> dict:
    """The training gain, final - step 0 held-out accuracy, paired by item: per seed a list of 0/1 per item, the
    same items at both steps; the bootstrap resamples the (seed, item) pairs (:func:`paired_bootstrap`).

    Raises:
        ValueError: the two lists differ in seeds or items.
    """
    if len(step0_correct) != len(final_correct) or any(len(a) != len(b) for a, b in zip(step0_correct, final_correct)):
        raise ValueError("step0_correct and final_correct need the same seeds and items (one 0/1 per item).")
    pairs = [float(f) - float(s) for seeds in zip(step0_correct, final_correct) for s, f in zip(*seeds)]
    return paired_bootstrap(pairs, **bootstrap)


def gain_difference(runs: list[dict], reference: list[dict], key: str = "outcomes", **bootstrap) -> dict:
    """One arm's training gain minus another's, paired by (seed, item): per seed that both ran and per held-out item,
    ``(final - step 0)`` of ``runs`` minus the same of ``reference`` (0/1 outcomes, or per-item scores in [0, 1]),
    pooled over seeds; the bootstrap resamples the pairs (:func:`paired_bootstrap`). Arms that share their step-0
    evaluation (the same engines, ``triage_trl.lab.step0``) reduce to their final outcomes' difference.

    Args:
        runs, reference: ``[{"seed", "held_out"}]``, ``held_out`` the run's evaluation records in step order, the
            first at step 0, each with ``key`` (one value per item, the same items in both arms).
        key: ``outcomes`` (greedy), ``item_scores`` (avg@N), ``learner_outcomes``, ``learner_item_scores``.

    Returns:
        ``{"mean", "low", "high", "n"}`` in accuracy units (``n``: pairs); NaN and ``n`` 0 without a common seed
        whose records carry ``key``.

    Raises:
        ValueError: a common seed's two arms scored different numbers of items.
    """
    def per_item(run):
        held = run.get("held_out") or []
        if len(held) < 2 or key not in held[0] or key not in held[-1]:
            return None
        return [float(f) - float(s) for s, f in zip(held[0][key], held[-1][key], strict=True)]

    by_seed = {r.get("seed"): per_item(r) for r in reference}
    diffs = []
    for run in runs:
        mine, theirs = per_item(run), by_seed.get(run.get("seed"))
        if mine is None or theirs is None:
            continue
        if len(mine) != len(theirs):
            raise ValueError(f"Seed {run.get('seed')}: {len(mine)} items against {len(theirs)} in the reference arm; "
                             "compare runs of the same lab folder (the same held-out items).")
        diffs += [a - b for a, b in zip(mine, theirs)]
    return paired_bootstrap(diffs, **bootstrap)


def k3_log_slope(steps: list[int], k3: list[float]) -> float:
    """Stability trend: least-squares slope of ln k3 over optimizer steps (per step; 0.01 = +1%/step). Steps with a
    non-finite or non-positive k3 are left out; NaN with fewer than 2 steps left."""
    points = [(s, math.log(v)) for s, v in zip(steps, k3) if math.isfinite(v) and v > 0]
    if len(points) < 2:
        return math.nan
    mean_s = statistics.fmean(s for s, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    var = sum((s - mean_s) ** 2 for s, _ in points)
    return sum((s - mean_s) * (y - mean_y) for s, y in points) / var if var else math.nan


def collapse_by_rule(rewards: list[float], k3: list[float], grad_norms: list[float]) -> dict:
    """The pre-registered collapse rule over one run's per-step series (same length, step order). Collapsed when any
    of: (1) the :data:`COLLAPSE_REWARD_WINDOW`-step moving mean reward falls >= :data:`COLLAPSE_REWARD_DROP` below
    its running peak and is still >= that far below the peak at the last step (no recovery); (2) k3 >=
    :data:`COLLAPSE_K3_FACTOR` x the mean k3 of the first :data:`COLLAPSE_K3_BASELINE_STEPS` steps, at a later step;
    (3) a non-finite grad norm.

    Returns:
        ``{"collapsed": bool, "reason": "reward" | "k3" | "grad_norm" | None, "step": 1-based index of the first
        step that met a criterion (for "reward": where the drop was first reached) or None, "criteria": {reason:
        its first step} for every criterion met}``; the earliest criterion wins. ``criteria`` lets a report read
        a run by one criterion (E3's k3 rises by design: docs/stability.md, "E3").
    """
    found = []
    for i, g in enumerate(grad_norms):
        if not math.isfinite(g):
            found.append((i + 1, "grad_norm"))
            break
    if len(k3) > COLLAPSE_K3_BASELINE_STEPS:
        base = [v for v in k3[:COLLAPSE_K3_BASELINE_STEPS] if math.isfinite(v)]
        if base and statistics.fmean(base) > 0:
            limit = COLLAPSE_K3_FACTOR * statistics.fmean(base)
            for i in range(COLLAPSE_K3_BASELINE_STEPS, len(k3)):
                if not math.isfinite(k3[i]) or k3[i] >= limit:
                    found.append((i + 1, "k3"))
                    break
    w = COLLAPSE_REWARD_WINDOW
    if len(rewards) >= w:
        moving = [statistics.fmean(rewards[i - w + 1:i + 1]) for i in range(w - 1, len(rewards))]
        peak, first_drop = -math.inf, None
        for j, m in enumerate(moving):
            peak = max(peak, m)
            if first_drop is None and m <= peak - COLLAPSE_REWARD_DROP:
                first_drop = j + w
        if first_drop is not None and moving[-1] <= max(moving) - COLLAPSE_REWARD_DROP:
            found.append((first_drop, "reward"))
    if not found:
        return {"collapsed": False, "reason": None, "step": None, "criteria": {}}
    step, reason = min(found)
    return {"collapsed": True, "reason": reason, "step": step, "criteria": {r: i for i, r in sorted(found)}}


def cost_gain_stability(runs: list[dict], reference: list[dict] | None, *, samples_key: str | None = None) -> dict:
    """Cost, gain and stability of one configuration@dose over its seeds (the lab's three numbers).

    Args:
        runs: one dict per seed: ``{"seed", "held_out": [evaluation records, step 0 first, with "outcomes" (0/1 per
            item) and, with samples, "item_scores"], "history": [log records], "probe": [fixed-probe records]}``.
        reference: the same for the reference configuration (bf16), or ``None``; its step 0 is matched by seed
            (else its first seed: every seed starts from the same weights and held-out items).
        samples_key: the avg@N key of the evaluation records (e.g. ``"avg_at_8"``), or ``None``.

    Returns:
        ``cost`` (reference's step-0 greedy accuracy minus the run's, paired by item, pooled over seeds; in
        [-1, 1]), ``gain`` (final - step-0 greedy accuracy, :func:`training_gain`), ``gain_sampled`` (the same on
        each item's share of correct samples), ``gain_learner`` and ``gain_learner_sampled`` (the same for the
        learner's own weights, ``learner_*`` records), each ``{"mean", "low", "high", "n"}`` (NaN where the records
        lack per-item outcomes); ``k3_slope`` and ``probe_k3_slope`` (mean over seeds of :func:`k3_log_slope` of the
        training batch's ``triage/k3_kl`` and of the fixed probe's k3); ``collapses``: :func:`collapse_by_rule`
        per seed, its ``step`` the optimizer step (rewards and k3 are logged at rollout steps only when a rollout
        serves several updates; the grad norm at every step).
    """
    nan = {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}

    def outcomes(run, index, key):
        held = run.get("held_out") or []
        return held[index].get(key) if held and key in held[index] else None

    gains = {}
    for name, key in (("gain", "outcomes"), ("gain_sampled", "item_scores" if samples_key else None),
                      ("gain_learner", "learner_outcomes"),
                      ("gain_learner_sampled", "learner_item_scores" if samples_key else None)):
        pairs = [(outcomes(r, 0, key), outcomes(r, -1, key)) for r in runs] if key else []
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None and len(a) == len(b)]
        gains[name] = training_gain([a for a, _ in pairs], [b for _, b in pairs]) if pairs else dict(nan)
    cost = dict(nan)
    if reference:
        by_seed = {r.get("seed"): r for r in reference}
        diffs = []
        for r in runs:
            ref = by_seed.get(r.get("seed"), reference[0])
            mine, theirs = outcomes(r, 0, "outcomes"), outcomes(ref, 0, "outcomes")
            if mine is not None and theirs is not None and len(mine) == len(theirs):
                diffs += [float(t) - float(m) for m, t in zip(mine, theirs)]
        cost = paired_bootstrap(diffs) if diffs else cost
    slopes, probe_slopes, collapses = [], [], []
    for r in runs:
        history = r.get("history") or []
        slopes.append(k3_log_slope(*step_series(history, "triage/k3_kl")))
        probe = r.get("probe") or []
        probe_slopes.append(k3_log_slope([p["step"] for p in probe], [p["k3"] for p in probe]))
        collapses.append(run_collapse(history))
    return {"cost": cost, **gains, "k3_slope": mean_std(slopes)[0], "probe_k3_slope": mean_std(probe_slopes)[0],
            "collapses": collapses}


def run_collapse(history: list[dict]) -> dict:
    """:func:`collapse_by_rule` on one run's log history, its ``step`` the optimizer step (rewards and k3 are logged
    at rollout steps only when a rollout serves several updates; the grad norm at every step)."""
    steps, k3 = step_series(history, "triage/k3_kl")
    reward_steps, rewards = step_series(history, "reward")
    grad_steps, grad_norms = every_step_series(history, "grad_norm")
    verdict = collapse_by_rule(rewards, k3, grad_norms)
    series_steps = {"reward": reward_steps, "k3": steps, "grad_norm": grad_steps}
    verdict["criteria"] = {r: series_steps[r][i - 1] for r, i in verdict["criteria"].items()}  # -> optimizer steps
    if verdict["collapsed"]:  # the earliest by optimizer step (the series are logged at different steps)
        verdict["step"], verdict["reason"] = min((step, r) for r, step in verdict["criteria"].items())
    return verdict


def collapse_rule_text() -> str:
    """The pre-registered collapse rule (:func:`collapse_by_rule`) in one markdown line."""
    return (f"**collapse (pre-registered)**: the {COLLAPSE_REWARD_WINDOW}-step moving mean training reward falls >= "
            f"{COLLAPSE_REWARD_DROP:g} below its running peak and is still that far below at the last step, or a "
            f"step's k3 >= {COLLAPSE_K3_FACTOR:g} x the mean k3 of the first {COLLAPSE_K3_BASELINE_STEPS} steps, or "
            "a non-finite grad norm; each criterion a collapsed seed met is listed with its first optimizer step "
            "(for the reward, where the drop was first reached, which may be a dip the run later recovered from "
            "before it fell for good). At E3's hot-sampler doses k3 rises by design: E3 is read by reward and grad "
            "norm (docs/stability.md, \"Pre-registered rules\").")
