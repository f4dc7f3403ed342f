"""The stability lab's configurations and scale presets (``docs/stability.md``).

A configuration is a name, a one-line description and overrides of ``TriageGRPOConfig`` applied on top of the
demo's config (:func:`triage_trl.runs.build_config`: CPU, colocated vLLM, DAPO loss, beta 0.04, constant learning
rate). Every configuration logs the ``triage/`` metrics (``triage_mode`` is ``"diagnose"`` or ``"full"``), so the
learner-sampler mismatch (``triage/k3_kl``, nats/token) is measured the same way in all of them; ``diagnose``
keeps every TRIAGE weight at 1 (plain GRPO loss, or TRL's correction when it is requested).

A mismatch dose (:data:`DOSES`) is the NVFP4 layer recipe of a run, named by the learner-sampler mismatch it
produces: ``paper`` (attention and the boundary blocks in bf16, the regime of published NVFP4 RL) and ``stress``
(every decoder linear in NVFP4). Every NVFP4 configuration runs at each dose of the lab, the ablations at one dose
(``ablation_dose``), ``bf16`` once (it has no dose). A run is named ``<configuration>@<dose>`` (``bf16`` alone).

A scale preset fixes the model, the task, the run size (steps, prompts, completions, held-out slice) and the doses.
Every value can be overridden from the command line (:func:`add_setting_arguments`, :func:`resolve_settings`). This
module imports neither torch nor TRL.
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass, field

NVFP4 = {"learner_precision": "nvfp4", "sampler_precision": "nvfp4"}
BF16_BOTH = {"learner_precision": "bf16", "sampler_precision": "bf16"}
TRIAGE_FULL = {**NVFP4, "triage_mode": "full"}
NAIVE = {**NVFP4, "triage_mode": "diagnose", "vllm_importance_sampling_correction": False}
BF16_LEARNER = {"learner_precision": "bf16", "sampler_precision": "nvfp4"}
TIS = {"triage_mode": "diagnose", "vllm_importance_sampling_correction": True,
       "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0}
OPSM_THRESHOLD = 0.5
"""``off_policy_mask_threshold`` of ``nvfp4_opsm`` (nats/token): DeepSeek-V3.2's delta, TRL's documented example
value. A negative-advantage completion is dropped when its mean sampler-over-learner log-ratio exceeds it. That mean
estimates the per-token KL(sampler || learner), which k3 also estimates: 0.09-0.25 nats/token at the ``stress`` dose,
0.01-0.05 at ``paper`` (docs/stability.md). At 0.5 OPSM drops the completions whose mismatch is 2-5x the ``stress``
dose's average, the sequence-level tail (the analogue of TRIAGE's NA tail), and almost none at ``paper``; a
threshold near the average would drop most negative completions and turn OPSM into positive-only training."""


@dataclass(frozen=True)
class LabConfig:
    """One configuration of the lab: ``overrides`` are ``TriageGRPOConfig`` fields (they win over the demo's);
    an ``ablation`` runs only at the lab's ``ablation_dose``; ``learning_rate_from`` names the run that scales
    the learning rate (the effective-step control)."""

    name: str
    description: str
    overrides: dict = field(default_factory=dict)
    ablation: bool = False
    learning_rate_from: str | None = None
    """A configuration whose run (same dose, same seed, same lab folder) sets this one's learning rate: the scale's
    learning rate times that run's mean TRIAGE weight (:func:`triage_trl.lab.metrics.mean_triage_weight`). That run
    must have finished first (it comes earlier in the registry, so a seed-major lab runs it first)."""

    @property
    def uses_nvfp4(self) -> bool:
        """Whether the learner or the sampler runs NVFP4 (then the run has a dose)."""
        return "nvfp4" in (self.overrides.get("learner_precision"), self.overrides.get("sampler_precision"))


@dataclass(frozen=True)
class Dose:
    """A mismatch dose: the NVFP4 layer recipe (``overrides``, ``TriageGRPOConfig`` fields) of an NVFP4 run, or
    (E3) a sampler hotter than the learner: ``sampler_temperature`` = the factor at the first and the last step
    (:mod:`triage_trl.lab.hot_sampler`), with both engines in bf16 (its overrides)."""

    name: str
    description: str
    overrides: dict
    sampler_temperature: tuple[float, float] | None = None


DOSES: dict[str, Dose] = {d.name: d for d in [
    Dose("paper", "the regime of published NVFP4 RL: nvfp4_recipe='paper' (attention, the first 4% and the last 15% "
         "of the blocks in bf16; the other blocks' MLP in NVFP4)", {"nvfp4_recipe": "paper"}),
    Dose("stress", "every decoder linear in NVFP4 (nvfp4_recipe='all'): on SmolLM2-135M about 3x the paper "
         "recipe's k3 against the float model (docs/nvfp4.md)", {"nvfp4_recipe": "all"}),
    Dose("hot_1.15", "E3: no quantisation (both engines bf16); the sampler samples at 1.0 -> 1.15 x the learner's "
         "temperature, rising linearly over the run (lab only: triage_trl.lab.hot_sampler)", dict(BF16_BOTH),
         sampler_temperature=(1.0, 1.15)),
    Dose("hot_1.3", "E3: as hot_1.15, the sampler at 1.0 -> 1.3 x the learner's temperature", dict(BF16_BOTH),
         sampler_temperature=(1.0, 1.3)),
]}
"""The doses: the NVFP4 recipes (smallest mismatch first), then E3's hot-sampler doses (configurations' NVFP4
precisions replaced by bf16: the only mismatch is the sampler's temperature)."""
NVFP4_DOSES = [name for name, d in DOSES.items() if d.sampler_temperature is None]
"""The NVFP4 recipe doses (the presets' default)."""


_REGISTRY = [
    LabConfig("bf16", "(a) bf16 sampler + full-precision learner (float32 on CPU, as the demo), plain GRPO loss "
              "(diagnose: TRIAGE only measures)",
              {"learner_precision": "bf16", "sampler_precision": "bf16", "triage_mode": "diagnose",
               "vllm_importance_sampling_correction": False}),
    LabConfig("nvfp4_naive", "(b) NVFP4 sampler + NVFP4 learner, no correction: plain GRPO loss (diagnose: TRIAGE "
              "only measures; the run for the paper's observations)",
              dict(NAIVE)),
    LabConfig("nvfp4_tis", "(c) NVFP4 + TRL token-level truncated importance sampling: ratio "
              "exp(learner - sampler log-prob) per token, clipped at 2.0 (token_truncate, clip_max=2)",
              {**NVFP4, **TIS}),
    LabConfig("nvfp4_seq_mask", "(d) NVFP4 + TRL 1.16's default correction: sequence_mask, the sequence ratio "
              "exp(sum of per-token log-ratios) zeroes a completion above clip_max=3.0 (clip_min unset: no lower "
              "bound)",
              {**NVFP4, "triage_mode": "diagnose", "vllm_importance_sampling_correction": True}),
    LabConfig("nvfp4_opsm", f"(f) NVFP4 + TRL 1.16's off-policy sequence masking (DeepSeek-V3.2's OPSM): a "
              f"completion with a negative advantage is dropped when its mean sampler-over-learner log-ratio exceeds "
              f"off_policy_mask_threshold={OPSM_THRESHOLD} nats/token (the NA quadrant at sequence level)",
              {**NAIVE, "off_policy_mask_threshold": OPSM_THRESHOLD}),
    LabConfig("triage", "(e) NVFP4 + TRIAGE full: classify, diagnose hot segments, rebalance, bounded repair "
              "(spec defaults)", dict(TRIAGE_FULL)),
    LabConfig("direction_blind", "(g) control: TRIAGE's tokens (hot segments, repaired tokens) reweighted "
              "regardless of quadrant, each by TRIAGE's mean weight over them (triage_direction='blind'): same "
              "tokens, same mean weight, no direction", {**TRIAGE_FULL, "triage_direction": "blind"}),
    LabConfig("effective_step", "(h) control: naive NVFP4 at the learning rate times the mean TRIAGE weight "
              "(triage/weight_mean over the steps) of the triage run of the same dose and seed", dict(NAIVE),
              learning_rate_from="triage"),
    LabConfig("bf16_learner_nvfp4_sampler", "(i) full-precision learner (float32 on CPU, bf16 on GPU) + NVFP4 "
              "sampler, plain GRPO loss: QUADS's configuration; the learner's own weights carry no quantisation "
              "cost", {**BF16_LEARNER, "triage_mode": "diagnose", "vllm_importance_sampling_correction": False}),
    # The corrections on (i): the one configuration whose mismatch is all the sampler's (the learner computes in
    # full precision), so any difference from (i) is the objective's (docs/stability.md, E2).
    LabConfig("bf16_learner_tis", "(i) + (c): the full-precision learner and NVFP4 sampler of (i), corrected by "
              "TRL's token-level truncated importance sampling (token_truncate, clip_max=2)", {**BF16_LEARNER, **TIS}),
    LabConfig("bf16_learner_opsm", f"(i) + (f): the learner and sampler of (i), corrected by TRL's off-policy "
              f"sequence masking at off_policy_mask_threshold={OPSM_THRESHOLD}",
              {**BF16_LEARNER, "triage_mode": "diagnose", "vllm_importance_sampling_correction": False,
               "off_policy_mask_threshold": OPSM_THRESHOLD}),
    LabConfig("bf16_learner_triage", "(i) + (e): the learner and sampler of (i), with TRIAGE full (spec defaults)",
              {**BF16_LEARNER, "triage_mode": "full", "vllm_importance_sampling_correction": False}),
    LabConfig("triage_no_rebalance", "(e) without rebalancing: triage_rebalance_floor=1.0 makes beta = 1 (no "
              "dedicated switch); repair unchanged", {**TRIAGE_FULL, "triage_rebalance_floor": 1.0}, ablation=True),
    LabConfig("triage_no_repair", "(e) without repair: triage_repair_mode='none'; rebalancing unchanged",
              {**TRIAGE_FULL, "triage_repair_mode": "none"}, ablation=True),
    LabConfig("triage_repair_mask", "(e) repair by masking: triage_repair_mode='mask' (severe tokens get weight 0, "
              "MIS-style) instead of the bounded excess-IS weight", {**TRIAGE_FULL, "triage_repair_mode": "mask"}, ablation=True),
    LabConfig("triage_scope_tail", "(e) rebalancing on tail tokens only: triage_rebalance_scope='tail' (not every "
              "token of the heavier amplifying quadrant in a hot segment)",
              {**TRIAGE_FULL, "triage_rebalance_scope": "tail"}, ablation=True),
    LabConfig("triage_fixed_segments", "(e) fixed 16-token windows instead of newline segments: "
              "triage_segment_mode='fixed', triage_segment_max_tokens=16 (the default 64 would make a whole "
              "32-token CPU completion one segment)",
              {**TRIAGE_FULL, "triage_segment_mode": "fixed", "triage_segment_max_tokens": 16}, ablation=True),
]
CONFIGS: dict[str, LabConfig] = {c.name: c for c in _REGISTRY}
"""The configurations, in table order."""

# Per-run settings (the worker's knobs); `seeds` and `configs` are the lab's.
SETTING_KEYS = ("model", "task", "data_path", "max_steps", "prompts_per_step", "num_generations",
                "max_completion_length", "temperature", "learning_rate", "lora_rank", "train_size", "eval_size",
                "eval_every", "eval_samples", "eval_sampled_items", "num_iterations", "probe_every")

SCALES: dict[str, dict] = {
    # SmolLM2-135M-Instruct on the embedded reasoning-gym task with the demo's budget (`triage_trl.runs.DEMO_DEFAULTS`,
    # tested equal: 12 steps of 2 prompts x 8 completions, LoRA rank 16 at lr 1e-4, 32 tokens, T 0.7), held-out
    # accuracy on 128 items (32 resolve nothing: one item is 3 points) at steps 0 and 12. With the task's one-shot
    # example showing a negative answer, bf16 GRPO gains in this budget on 3 of 3 seeds (docs/stability.md, "A prompt
    # with headroom"); with the former, positive one it had 4 items of headroom.
    # Measured per run on a 2-core CPU with AVX512-BF16: start-up 40 s, step ~32 s, evaluation ~30 s (AVX2-only
    # CPUs: about 2x).
    "cpu": dict(
        model=None, task="reasoning_gym", data_path=None, max_steps=12, prompts_per_step=2, num_generations=8,
        max_completion_length=32, temperature=0.7, learning_rate=1e-4, lora_rank=16, train_size=256, eval_size=128,
        eval_every=12, eval_samples=0, num_iterations=1, probe_every=0,
        seeds=[0, 1, 2], configs=list(CONFIGS), doses=list(NVFP4_DOSES), ablation_dose="paper", trainer_overrides={},
        estimate=dict(startup_s=40.0, step_s=32.0, eval_s=30.0),
    ),
    # CI/tests: a tiny random Qwen3 (`tiny-qwen3`, built once in the lab folder), 1 step.
    "smoke": dict(
        model="tiny-qwen3", task="reasoning_gym", data_path=None, max_steps=1, prompts_per_step=2, num_generations=2,
        max_completion_length=8, temperature=0.7, learning_rate=1e-4, lora_rank=0, train_size=8, eval_size=4,
        eval_every=1, eval_samples=2, num_iterations=1, probe_every=1,
        seeds=[0], configs=list(CONFIGS), doses=["stress"], ablation_dose="stress", trainer_overrides={},
        estimate=dict(startup_s=25.0, step_s=3.0, eval_s=1.0),
    ),
    # E2, the collapse hunt (docs/stability.md, "E2"): the conditions of the published mismatch collapses at CPU
    # size. Full fine-tuning of SmolLM2-135M, temperature 1, no KL anchor (beta 0), 2 policy updates per rollout
    # (num_iterations 2: 100 optimizer steps = 50 rollouts of 2 prompts x 8), 1-2 digit sums (2-line completions:
    # SmolLM2 does not write longer work at T = 1, measured), a held-out slice of 256 items with none among the
    # training items, greedy and avg@8 at the training temperature at step 0 and at the end, the fixed probe every
    # 5 steps. The learning rate is the ladder's (docs/stability.md): 3e-5 kept bf16 stable for 30 steps, 1e-4 took
    # its held-out accuracy from 31% to 0.
    "collapse": dict(
        model=None, task="chain_sum_2d", data_path=None, max_steps=100, prompts_per_step=2, num_generations=8,
        max_completion_length=64, temperature=1.0, learning_rate=3e-5, lora_rank=0, train_size=512, eval_size=256,
        eval_every=100, eval_samples=8, eval_sampled_items=64, num_iterations=2, probe_every=5,
        seeds=[0], configs=["bf16", "bf16_learner_nvfp4_sampler", "nvfp4_naive", "nvfp4_tis", "nvfp4_opsm", "triage"],
        doses=["stress"], ablation_dose="stress", trainer_overrides={"beta": 0.0, "save_strategy": "steps", "save_steps": 10, "save_total_limit": 1},
        # measured 2026-12-05 on a quiet 2-core AVX2 EPYC (nvfp4_naive): 13-18 s a step, 4.5 min a held-out evaluation
        estimate=dict(startup_s=30.0, step_s=16.0, eval_s=270.0),
    ),
    # Documented for GPU runs, not run on this machine: Qwen3-4B on GSM8K with the knobs of recipes/qwen3_4b_*.yaml
    # (32 completions per step = 4 prompts x 8 as 8 per device x 4 accumulation steps, 1024 completion tokens,
    # temperature 1, learning rate 1e-6 after 10 warm-up steps, 500 steps).
    "gpu": dict(
        model="Qwen/Qwen3-4B", task="gsm8k", data_path=None, max_steps=500, prompts_per_step=4, num_generations=8,
        max_completion_length=1024, temperature=1.0, learning_rate=1e-6, lora_rank=0, train_size=None,
        eval_size=500,
        eval_every=50, eval_samples=8, num_iterations=1, probe_every=10, seeds=[0, 1, 2], configs=list(CONFIGS),
        doses=list(NVFP4_DOSES), ablation_dose="paper",
        trainer_overrides={
            "use_cpu": False, "bf16": True, "model_init_kwargs": {"dtype": "bfloat16"}, "beta": 0.0,
            "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
            "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 10, "gradient_checkpointing": True,
            "vllm_max_model_length": 2048, "vllm_gpu_memory_utilization": 0.35, "nvfp4_calibration_prompts": 64,
        },
        estimate=dict(startup_s=300.0, step_s=60.0, eval_s=120.0),
    ),
}


def uncorrected_arm(name: str) -> str | None:
    """The configuration whose plain GRPO loss on the same engines a correction is measured against: the
    bf16-learner + NVFP4-sampler arm for its corrections, ``nvfp4_naive`` for every other NVFP4-learner
    configuration (corrections, controls, ablations); ``None`` for those two and ``bf16``.

    Raises:
        KeyError: unknown name.
    """
    config = lab_config(name)
    engines = (config.overrides.get("learner_precision"), config.overrides.get("sampler_precision"))
    reference = {("bf16", "nvfp4"): "bf16_learner_nvfp4_sampler", ("nvfp4", "nvfp4"): "nvfp4_naive"}.get(engines)
    return None if reference == name else reference


PUBLISHED_CORRECTIONS = {"triage": ("nvfp4_tis", "nvfp4_opsm"),
                         "bf16_learner_triage": ("bf16_learner_tis", "bf16_learner_opsm")}
"""Each TRIAGE arm's published alternatives on the same engines (TRL's token TIS, OPSM): the head-to-head table of
``lab.summarize`` (a comparison the pre-registered rules do not make)."""


def config_names() -> list[str]:
    """The configuration names, in table order."""
    return list(CONFIGS)


def lab_config(name: str) -> LabConfig:
    """The configuration ``name``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    return _lookup(CONFIGS, name, "lab configuration")


def lab_dose(name: str) -> Dose:
    """The dose ``name``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    return _lookup(DOSES, name, "dose")


def _lookup(registry: dict, name: str, kind: str):
    if name not in registry:
        raise KeyError(f"Unknown {kind} {name!r}: use one of {', '.join(registry)}.")
    return registry[name]


def run_label(config: str, dose: str | None) -> str:
    """The name of a run's row and folder: ``<configuration>@<dose>``, or the configuration alone without a dose."""
    return config if dose is None else f"{config}@{dose}"


def split_label(label: str) -> tuple[str, str | None]:
    """``(configuration, dose)`` of a :func:`run_label`."""
    config, _, dose = label.partition("@")
    return config, dose or None


def plan_runs(configs: list[str], seeds: list[int], doses: list[str], ablation_dose: str | None) -> list[tuple]:
    """The lab's runs ``(configuration, dose, seed)``, seed-major: for each seed, each configuration in order; a
    configuration without NVFP4 once (dose ``None``), an ablation at ``ablation_dose``, every other NVFP4
    configuration at each dose, except the bf16-learner configurations at E3's hot-sampler doses (which run both
    engines in bf16: there they would repeat the NVFP4-learner configuration with the same objective).

    Raises:
        KeyError: an unknown configuration or dose.
        ValueError: no dose for an NVFP4 configuration, an ``ablation_dose`` not among ``doses``, or nothing to run.
    """
    for name in doses:
        lab_dose(name)
    chosen = [lab_config(c) for c in configs]
    if not doses and any(c.uses_nvfp4 for c in chosen):
        raise ValueError("NVFP4 configurations need at least one dose: pass --doses (e.g. paper stress).")
    if any(c.ablation for c in chosen) and ablation_dose not in doses:
        raise ValueError(f"ablation_dose={ablation_dose!r} must be one of the lab's doses {doses}: pass "
                         "--ablation-dose.")
    plan = []
    for seed in seeds:
        for c in chosen:
            if not c.uses_nvfp4:
                plan.append((c.name, None, seed))
            elif c.ablation:
                plan.append((c.name, ablation_dose, seed))
            else:
                plan += [(c.name, d, seed) for d in doses
                         if not (DOSES[d].sampler_temperature and c.overrides.get("learner_precision") == "bf16")]
    if not plan:
        raise ValueError(f"Configurations {configs} at doses {doses} plan no run: the bf16-learner configurations do "
                         "not run at the hot-sampler doses (both engines bf16 there); pick the NVFP4-learner ones.")
    return plan


def scale_preset(scale: str) -> dict:
    """A deep copy of the preset ``scale``.

    Raises:
        KeyError: unknown scale.
    """
    if scale not in SCALES:
        raise KeyError(f"Unknown scale {scale!r}: use one of {', '.join(SCALES)}.")
    return copy.deepcopy(SCALES[scale])


def build_trainer_config(name: str, settings: dict, output_dir: str, seed: int, trainer_overrides: dict | None = None,
                         dose: str | None = None, learning_rate_scale: float = 1.0):
    """The ``TriageGRPOConfig`` of configuration ``name`` at ``dose`` for one run.

    Args:
        settings: the run settings (:data:`SETTING_KEYS`; e.g. a preset from :func:`resolve_settings`).
        output_dir: the run folder.
        trainer_overrides: the scale's extra ``TriageGRPOConfig`` fields (e.g. the GPU preset's); the
            configuration's own overrides win over them, the dose's over both.
        dose: a :data:`DOSES` name; required for an NVFP4 configuration, refused for the others.
        learning_rate_scale: multiplies the settings' learning rate (the effective-step control's scale), > 0.

    Raises:
        KeyError: unknown configuration or dose; ValueError: a missing or superfluous dose, or a combination
        ``TriageGRPOConfig`` refuses.
    """
    from ..runs import build_config

    config = lab_config(name)
    if config.uses_nvfp4 != (dose is not None):
        need = "needs a dose" if config.uses_nvfp4 else "runs no NVFP4 and takes no dose"
        raise ValueError(f"Configuration {name!r} {need} (got dose={dose!r}).")
    if not learning_rate_scale > 0:
        raise ValueError(f"learning_rate_scale={learning_rate_scale!r} must be > 0.")
    overrides = {**(trainer_overrides or {}), **config.overrides, **(lab_dose(dose).overrides if dose else {})}
    return build_config(
        output_dir, seed=seed,
        **{k: settings[k] for k in ("max_steps", "prompts_per_step", "num_generations", "max_completion_length",
                                    "temperature")},
        learning_rate=settings["learning_rate"] * learning_rate_scale,
        num_iterations=settings.get("num_iterations", 1),
        **overrides,
    )


# ---------------------------------------------------------------- command line

_FLAGS = [  # (flag, settings key, type, help)
    ("--model", "model", str, "local model folder or Hub id ('tiny-qwen3': a tiny random Qwen3; default: the scale's)"),
    ("--task", "task", str, "reasoning_gym (embedded, no network), chain_sum_2d (embedded, 1-2 digit terms), "
     "chain_lines (embedded, 3 terms worked one partial sum per line) or gsm8k"),
    ("--data-path", "data_path", str, "gsm8k: a jsonl file/folder or Hub id"),
    ("--steps", "max_steps", int, "optimizer steps per run"),
    ("--prompts-per-step", "prompts_per_step", int, "prompts per optimizer step"),
    ("--num-generations", "num_generations", int, "completions per prompt (the GRPO group)"),
    ("--max-completion-length", "max_completion_length", int, "completion tokens"),
    ("--temperature", "temperature", float, "sampling temperature"),
    ("--lora-rank", "lora_rank", int, "LoRA rank on every decoder linear; 0: full fine-tuning"),
    ("--learning-rate", "learning_rate", float, "constant learning rate"),
    ("--train-size", "train_size", int, "training items"),
    ("--eval-size", "eval_size", int, "held-out items, answered greedily"),
    ("--eval-every", "eval_every", int, "held-out evaluation every N optimizer steps (and at step 0 and the end)"),
    ("--eval-samples", "eval_samples", int, "avg@N at the training temperature beside greedy at each evaluation "
     "(0: greedy only)"),
    ("--eval-sampled-items", "eval_sampled_items", int, "avg@N on the first N held-out items only (default: the "
     "scale's; unset: all)"),
    ("--num-iterations", "num_iterations", int, "policy updates per rollout batch (TRL's num_iterations)"),
    ("--probe-every", "probe_every", int, "fixed-probe k3 every N optimizer steps (0: no fixed probe)"),
]


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--scale`` and one flag per run setting (default: the scale's value)."""
    parser.add_argument("--scale", default="cpu", choices=list(SCALES),
                        help="preset: cpu (default, SmolLM2-135M), collapse (E2: SmolLM2-135M full fine-tuning, "
                        "multi-line task, 100 steps), smoke (tiny model, CI), gpu (Qwen3-4B, GSM8K)")
    for flag, _, kind, text in _FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=f"{text} (default: the scale's)")


def resolve_settings(args: argparse.Namespace) -> dict:
    """The scale preset of ``args.scale`` with every flag given on the command line applied.

    Raises:
        ValueError: a size < 1, or ``eval_every`` < 1.
    """
    settings = scale_preset(args.scale)
    settings["scale"] = args.scale
    for flag, key, _, _ in _FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            settings[key] = value
    settings.setdefault("eval_samples", 0)
    settings.setdefault("num_iterations", 1)
    settings.setdefault("probe_every", 0)
    for key in ("max_steps", "prompts_per_step", "num_generations", "max_completion_length", "eval_size", "eval_every",
                "num_iterations"):
        if not isinstance(settings[key], int) or settings[key] < 1:
            raise ValueError(f"{key}={settings[key]!r} must be an integer >= 1.")
    for key in ("eval_samples", "probe_every"):
        if not isinstance(settings[key], int) or settings[key] < 0:
            raise ValueError(f"{key}={settings[key]!r} must be 0 (off) or a positive integer.")
    if not isinstance(settings["lora_rank"], int) or settings["lora_rank"] < 0:
        raise ValueError(f"lora_rank={settings['lora_rank']!r} must be 0 (full fine-tuning) or a positive integer.")
    return settings


def settings_to_argv(settings: dict) -> list[str]:
    """Command-line flags reproducing ``settings`` (for the worker subprocess)."""
    argv = ["--scale", settings["scale"]]
    for flag, key, _, _ in _FLAGS:
        if settings.get(key) is not None:
            argv += [flag, str(settings[key])]
    return argv


# ---------------------------------------------------------------- lab folder layout

PLAN_FILE = "lab.json"
"""The lab's plan (settings, configurations, seeds), written by ``benchmarks/stability_lab.py``."""


def run_path(lab_dir: str, config: str, seed: int, dose: str | None = None) -> str:
    """The folder of one run: ``LAB_DIR/runs/<config>@<dose>/seed<seed>`` (``runs/<config>/...`` without a dose)."""
    return os.path.join(lab_dir, "runs", run_label(config, dose), f"seed{seed}")


def lab_dir_of(run_dir: str) -> str:
    """The lab folder that holds ``run_dir`` (a :func:`run_path`)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(run_dir))))


def sibling_run_path(run_dir: str, config: str, seed: int, dose: str | None = None) -> str:
    """The folder of run ``(config, dose, seed)`` in the lab that holds ``run_dir`` (a :func:`run_path`)."""
    return run_path(lab_dir_of(run_dir), config, seed, dose)
