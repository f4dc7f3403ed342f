"""The stability lab (issue 7): the configuration registry, the summary rules on synthetic logs, the summary of a
synthetic lab folder, a worker failure being recorded, and one smoke lab run end to end (slow: real vLLM)."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest

import triage_trl
from triage_trl.lab.configs import (CONFIGS, DOSES, OPSM_THRESHOLD, SCALES, add_setting_arguments, build_trainer_config,
                                    plan_runs, resolve_settings, run_path, scale_preset, settings_to_argv, split_label)
from triage_trl.lab.metrics import (collapsed, count_spikes, format_mean_std, mean_std, mean_triage_weight, reward_auc,
                                    run_metrics)
from triage_trl.lab.summarize import dose_report, load_runs, observations, summarize
from script_module import load_script  # noqa: E402


def _lab_module():
    return load_script("benchmarks/stability_lab.py")


# ---------------------------------------------------------------- registry and settings

def test_registry_order_and_names():
    assert list(CONFIGS)[:12] == ["bf16", "nvfp4_naive", "nvfp4_tis", "nvfp4_seq_mask", "nvfp4_opsm", "triage",
                                  "direction_blind", "effective_step", "bf16_learner_nvfp4_sampler",
                                  "bf16_learner_tis", "bf16_learner_opsm", "bf16_learner_triage"]
    assert list(CONFIGS)[12:] == ["triage_no_rebalance", "triage_no_repair", "triage_repair_mask", "triage_scope_tail",
                                 "triage_fixed_segments"]
    assert all(c.description for c in CONFIGS.values())


@pytest.mark.parametrize("scale", ["cpu", "smoke", "collapse"])
def test_every_configuration_builds_a_valid_config(scale, tmp_path):
    from triage_trl.trainer import TriageGRPOConfig

    settings = scale_preset(scale)
    dose = settings["ablation_dose"]
    built = {name: build_trainer_config(name, settings, str(tmp_path / name), seed=1,
                                        trainer_overrides=settings["trainer_overrides"],
                                        dose=dose if CONFIGS[name].uses_nvfp4 else None) for name in CONFIGS}
    for name, config in built.items():
        assert isinstance(config, TriageGRPOConfig), name
        assert config.triage_mode in ("diagnose", "full") and config.seed == 1
        assert config.max_steps == settings["max_steps"] and config.learning_rate == settings["learning_rate"]
        assert config.per_device_train_batch_size == settings["prompts_per_step"] * settings["num_generations"]
        assert config.num_iterations == settings["num_iterations"]
        if name.startswith("bf16_learner"):
            assert (config.learner_precision, config.sampler_precision) == ("bf16", "nvfp4")
            continue
        expected = "bf16" if name == "bf16" else "nvfp4"
        assert config.learner_precision == config.sampler_precision == expected
    assert not built["bf16"].vllm_importance_sampling_correction
    assert not built["nvfp4_naive"].vllm_importance_sampling_correction
    tis = built["nvfp4_tis"]
    assert (tis.vllm_importance_sampling_correction, tis.vllm_importance_sampling_mode,
            tis.vllm_importance_sampling_clip_max, tis.vllm_importance_sampling_clip_min) \
        == (True, "token_truncate", 2.0, None)
    seq = built["nvfp4_seq_mask"]  # TRL 1.16's defaults, as the description states
    assert (seq.vllm_importance_sampling_correction, seq.vllm_importance_sampling_mode,
            seq.vllm_importance_sampling_clip_max, seq.vllm_importance_sampling_clip_min) \
        == (True, "sequence_mask", 3.0, None)
    assert "sequence_mask" in CONFIGS["nvfp4_seq_mask"].description and "3.0" in CONFIGS["nvfp4_seq_mask"].description
    assert built["nvfp4_opsm"].off_policy_mask_threshold == OPSM_THRESHOLD == 0.5
    opsm = ("nvfp4_opsm", "bf16_learner_opsm")
    assert all(built[n].off_policy_mask_threshold == OPSM_THRESHOLD for n in opsm)
    assert all(built[n].off_policy_mask_threshold is None for n in CONFIGS if n not in opsm)
    # the corrections on the bf16-learner arm: the same correction fields as on the NVFP4 learner
    correction = ("triage_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                  "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "off_policy_mask_threshold")
    for bf16_arm, nvfp4_arm in (("bf16_learner_tis", "nvfp4_tis"), ("bf16_learner_opsm", "nvfp4_opsm"),
                                ("bf16_learner_triage", "triage")):
        assert [getattr(built[bf16_arm], f) for f in correction] == [getattr(built[nvfp4_arm], f) for f in correction]
    for name in ("nvfp4_opsm", "effective_step", "bf16_learner_nvfp4_sampler"):  # plain GRPO loss, TRIAGE measures
        assert built[name].triage_mode == "diagnose" and not built[name].vllm_importance_sampling_correction, name
    blind = built["direction_blind"]
    assert (blind.triage_mode, blind.triage_direction, blind.vllm_importance_sampling_correction) \
        == ("full", "blind", False)
    assert all(built[n].triage_direction == "aware" for n in CONFIGS if n != "direction_blind")
    assert CONFIGS["effective_step"].learning_rate_from == "triage"
    assert list(CONFIGS).index("triage") < list(CONFIGS).index("effective_step")  # seed-major: triage runs first
    full = [n for n in CONFIGS if n.startswith("triage") or n == "bf16_learner_triage"]
    assert all(built[n].triage_mode == "full" and not built[n].vllm_importance_sampling_correction for n in full)
    assert built["triage_no_rebalance"].triage_rebalance_floor == 1.0
    assert built["triage_no_repair"].triage_repair_mode == "none"
    assert built["triage_repair_mask"].triage_repair_mode == "mask"
    assert built["triage_scope_tail"].triage_rebalance_scope == "tail"
    fixed = built["triage_fixed_segments"]
    assert (fixed.triage_segment_mode, fixed.triage_segment_max_tokens) == ("fixed", 16)
    base = built["triage"]
    assert (base.triage_rebalance_floor, base.triage_repair_mode, base.triage_rebalance_scope,
            base.triage_segment_mode) == (0.25, "excess_is", "segment", "newline")
    assert all(built[n].nvfp4_recipe == DOSES[dose].overrides["nvfp4_recipe"] for n in CONFIGS if n != "bf16")


def test_doses_set_the_nvfp4_recipe_and_bf16_takes_none(tmp_path):
    settings = scale_preset("cpu")
    assert list(DOSES) == ["paper", "stress", "hot_1.15", "hot_1.3"] and settings["doses"] == ["paper", "stress"]
    recipes = {d: build_trainer_config("triage", settings, str(tmp_path / d), seed=0, dose=d).nvfp4_recipe
               for d in settings["doses"]}
    assert recipes == {"paper": "paper", "stress": "all"}
    with pytest.raises(ValueError, match="needs a dose"):
        build_trainer_config("triage", settings, str(tmp_path / "x"), seed=0)
    with pytest.raises(ValueError, match="takes no dose"):
        build_trainer_config("bf16", settings, str(tmp_path / "y"), seed=0, dose="paper")
    with pytest.raises(KeyError, match="Unknown dose 'huge'"):
        build_trainer_config("triage", settings, str(tmp_path / "z"), seed=0, dose="huge")


def test_effective_step_learning_rate_is_scaled_by_the_triage_runs_mean_weight(tmp_path):
    from triage_trl.lab.worker import RUN_SUMMARY, learning_rate_scale

    history = [{"step": 1, "reward": 0.5, "triage/weight_mean": 0.9}, {"step": 1, "train_runtime": 3.0},
               {"step": 2, "reward": 0.4, "triage/weight_mean": 0.7}]
    assert mean_triage_weight(history) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="has not trained"):
        mean_triage_weight([{"step": 1, "train_runtime": 3.0}])
    lab = tmp_path / "lab"
    own = run_path(str(lab), "effective_step", 1, "stress")
    with pytest.raises(FileNotFoundError, match="run it first"):
        learning_rate_scale(own, "triage", 1, "stress")
    ref = run_path(str(lab), "triage", 1, "stress")
    os.makedirs(ref)
    with open(os.path.join(ref, "log_history.jsonl"), "w") as f:
        f.writelines(json.dumps(h) + "\n" for h in history)
    with open(os.path.join(ref, RUN_SUMMARY), "w") as f:
        json.dump({"status": "ok"}, f)
    scale = learning_rate_scale(own, "triage", 1, "stress")
    assert scale == pytest.approx(0.8)
    settings = scale_preset("cpu")
    config = build_trainer_config("effective_step", settings, own, seed=1, dose="stress", learning_rate_scale=scale)
    assert config.learning_rate == pytest.approx(0.8 * settings["learning_rate"])
    with pytest.raises(ValueError, match="learning_rate_scale"):
        build_trainer_config("effective_step", settings, own, seed=1, dose="stress", learning_rate_scale=0.0)


def test_plan_runs_every_nvfp4_configuration_at_each_dose_ablations_at_one():
    plan = plan_runs(["bf16", "nvfp4_naive", "triage", "triage_no_repair"], [0, 1], ["paper", "stress"], "paper")
    seed0 = [(c, d) for c, d, s in plan if s == 0]
    assert seed0 == [("bf16", None), ("nvfp4_naive", "paper"), ("nvfp4_naive", "stress"), ("triage", "paper"),
                     ("triage", "stress"), ("triage_no_repair", "paper")]
    assert [s for _, _, s in plan] == [0] * 6 + [1] * 6  # seed-major
    with pytest.raises(ValueError, match="--ablation-dose"):
        plan_runs(["triage_no_repair"], [0], ["stress"], "paper")
    with pytest.raises(ValueError, match="--doses"):
        plan_runs(["triage"], [0], [], None)
    assert plan_runs(["bf16"], [0], [], None) == [("bf16", None, 0)]
    # at E3's hot doses both engines are bf16: a bf16-learner configuration would repeat its NVFP4-learner twin
    hot = plan_runs(["nvfp4_naive", "bf16_learner_nvfp4_sampler", "triage", "bf16_learner_triage"], [0],
                    ["stress", "hot_1.3"], "stress")
    assert [(c, d) for c, d, _ in hot] == [("nvfp4_naive", "stress"), ("nvfp4_naive", "hot_1.3"),
                                           ("bf16_learner_nvfp4_sampler", "stress"), ("triage", "stress"),
                                           ("triage", "hot_1.3"), ("bf16_learner_triage", "stress")]
    with pytest.raises(ValueError, match="plan no run"):
        plan_runs(["bf16_learner_triage"], [0], ["hot_1.3"], None)
    assert run_path("/lab", "triage", 2, "paper") == os.path.join("/lab", "runs", "triage@paper", "seed2")
    assert split_label("triage@paper") == ("triage", "paper") and split_label("bf16") == ("bf16", None)


def test_gpu_preset_documents_the_qwen3_4b_recipe():
    gpu = SCALES["gpu"]
    assert (gpu["model"], gpu["task"], gpu["num_generations"], gpu["max_completion_length"], gpu["learning_rate"]) \
        == ("Qwen/Qwen3-4B", "gsm8k", 8, 1024, 1e-6)
    overrides = gpu["trainer_overrides"]
    assert overrides["beta"] == 0.0  # the recipes' (the demo's default is 0.04)
    assert overrides["per_device_train_batch_size"] * overrides["gradient_accumulation_steps"] \
        == gpu["prompts_per_step"] * gpu["num_generations"]


def test_collapse_preset_sets_the_published_collapse_conditions(tmp_path):
    """E2's preset: temperature 1, no KL anchor, 2 updates per rollout, full fine-tuning, multi-line completions,
    avg@8 and a fixed probe, checkpoints to resume a 100-step run."""
    settings = scale_preset("collapse")
    assert (settings["temperature"], settings["num_iterations"], settings["lora_rank"]) == (1.0, 2, 0)
    assert settings["max_steps"] >= 80 and settings["max_completion_length"] >= 64 and settings["task"] == "chain_sum_2d"
    assert settings["eval_size"] >= 256 and settings["eval_samples"] == 8 and settings["probe_every"] > 0
    assert settings["eval_sampled_items"] == 64  # avg@8 on 64 of the 256 items: 512 samples an evaluation
    config = build_trainer_config("nvfp4_naive", settings, str(tmp_path / "run"), seed=0,
                                  trainer_overrides=settings["trainer_overrides"], dose="stress")
    assert config.beta == 0.0 and config.temperature == 1.0 and config.num_iterations == 2
    assert config.save_strategy == "steps" and config.save_steps == 10 and config.save_total_limit == 1
    assert set(settings["configs"]) == {"bf16", "bf16_learner_nvfp4_sampler", "nvfp4_naive", "nvfp4_tis",
                                        "nvfp4_opsm", "triage"}


@pytest.mark.parametrize("task", ["chain_sum_2d", "chain_lines"])
def test_large_tasks_hold_out_items_no_lab_seed_trains_on(task):
    from triage_trl.eval.held_out import shared_prompts
    from triage_trl.lab.worker import load_datasets
    from triage_trl.runs import SEEDS_CHECKED as LAB_SEEDS_CHECKED

    settings = {**scale_preset("collapse"), "task": task, "train_size": 64, "eval_size": 32}
    held_out = load_datasets(settings, 0, 2)[1]
    assert len(held_out) == 32
    for seed in range(LAB_SEEDS_CHECKED):
        train = load_datasets(settings, seed, 2)[0]
        assert len(train) == 64 and shared_prompts(held_out, train) == 0
    question = held_out[0]["prompt"][-1]["content"]
    terms = question.split(":")[-1].count("+") + question.split(":")[-1].count("-") + 1
    assert terms == (3 if task == "chain_lines" else 2)
    example_lines = held_out[0]["prompt"][1]["content"].count("\n") + 1
    assert example_lines == (3 if task == "chain_lines" else 2)  # one partial sum per line, then the answer


def test_hot_sampler_doses_run_both_engines_bf16_with_a_rising_sampler_temperature(tmp_path):
    from types import SimpleNamespace

    from triage_trl.lab.hot_sampler import HotSampler, ramp

    settings = scale_preset("collapse")
    for dose, end in (("hot_1.15", 1.15), ("hot_1.3", 1.3)):
        config = build_trainer_config("triage", settings, str(tmp_path / dose), seed=0,
                                      trainer_overrides=settings["trainer_overrides"], dose=dose)
        assert (config.learner_precision, config.sampler_precision, config.triage_mode) == ("bf16", "bf16", "full")
        assert DOSES[dose].sampler_temperature == (1.0, end)
    assert [ramp(s, 5, 1.0, 1.3) for s in (1, 3, 5, 9)] == pytest.approx([1.0, 1.15, 1.3, 1.3])
    trainer = SimpleNamespace(args=SimpleNamespace(temperature=0.8), vllm_generation=SimpleNamespace(temperature=0.8))
    hot = HotSampler(trainer, 1.0, 1.5)
    for step in range(3):
        hot.on_step_begin(None, SimpleNamespace(global_step=step, max_steps=3), None)
    assert hot.temperatures == pytest.approx([0.8, 1.0, 1.2])
    assert trainer.vllm_generation.temperature == pytest.approx(1.2)
    with pytest.raises(ValueError, match="1 <= start <= end"):
        HotSampler(trainer, 0.9, 1.3)


def test_step0_identity_is_shared_across_objectives_only(tmp_path):
    """Runs that differ only in their loss share one step-0 evaluation; precision, recipe, seed or model do not."""
    from triage_trl.lab.step0 import step0_identity

    settings = {**scale_preset("collapse"), "scale": "collapse"}

    def identity(config, dose="stress", seed=0, model="m", **changes):
        args = build_trainer_config(config, {**settings, **changes}, str(tmp_path / config), seed,
                                    settings.get("trainer_overrides"), dose)
        return step0_identity(args, {**settings, **changes}, seed, model)

    naive = identity("nvfp4_naive")
    assert naive == identity("nvfp4_tis") == identity("nvfp4_opsm") == identity("triage")
    assert naive == identity("nvfp4_naive", learning_rate=1e-5)  # a ladder's rungs start from the same weights
    assert identity("bf16", None) == identity("nvfp4_naive", "hot_1.15") == identity("triage", "hot_1.3")
    others = {identity("bf16", None), identity("bf16_learner_nvfp4_sampler"), identity("nvfp4_naive", "paper"),
              identity("nvfp4_naive", seed=1), identity("nvfp4_naive", model="other"),
              identity("nvfp4_naive", eval_samples=4), identity("nvfp4_naive", temperature=0.7)}
    assert naive not in others and len(others) == 7


def test_step0_identity_follows_the_engines_dtype(tmp_path, monkeypatch):
    """A lab folder moved to a CPU of another kind (bf16 engines with AVX512-BF16, float32 on AVX2) shares nothing."""
    from triage_trl import runtime
    from triage_trl.lab.step0 import step0_identity

    settings = {**scale_preset("collapse"), "scale": "collapse"}
    args = build_trainer_config("nvfp4_naive", settings, str(tmp_path / "n"), 0, settings.get("trainer_overrides"),
                                "hot_1.15")
    ids = set()
    for native in (True, False):
        monkeypatch.setattr(runtime, "native_bf16_gemm", lambda device="cpu", native=native: native)
        ids.add(step0_identity(args, settings, 0, "m"))
    assert len(ids) == 2


def test_resumed_run_keeps_the_log_records_up_to_its_checkpoint(tmp_path):
    from triage_trl.lab.worker import keep_records_up_to, read_records

    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"step": 0, "a": 1}, {"step": 10}, {"step": 11},
                                                             {"x": 2}]))
    keep_records_up_to(str(path), 10)
    assert read_records(str(path)) == [{"step": 0, "a": 1}, {"step": 10}, {"x": 2}]
    keep_records_up_to(str(tmp_path / "missing.jsonl"), 3)  # nothing to cut: no file made
    assert not (tmp_path / "missing.jsonl").exists() and read_records(str(tmp_path / "missing.jsonl")) == []


def test_cpu_preset_runs_the_demo_budget():
    from triage_trl.demo import DEMO_DEFAULTS

    cpu = SCALES["cpu"]
    shared = ("max_steps", "prompts_per_step", "num_generations", "max_completion_length", "temperature",
              "learning_rate", "lora_rank", "train_size", "eval_size")
    assert {k: cpu[k] for k in shared} == {k: DEMO_DEFAULTS[k] for k in shared}
    assert cpu["eval_every"] == cpu["max_steps"] and cpu["eval_size"] >= 128
    assert SCALES["smoke"]["lora_rank"] == SCALES["gpu"]["lora_rank"] == 0


def test_command_line_overrides_win_and_round_trip():
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    settings = resolve_settings(parser.parse_args(["--steps", "3", "--learning-rate", "1e-4", "--eval-every", "2",
                                                   "--model", "/some/model", "--lora-rank", "0"]))
    assert (settings["max_steps"], settings["learning_rate"], settings["eval_every"], settings["model"],
            settings["lora_rank"]) == (3, 1e-4, 2, "/some/model", 0)
    assert settings["num_generations"] == SCALES["cpu"]["num_generations"]
    again = resolve_settings(parser.parse_args(settings_to_argv(settings)))
    assert {k: again[k] for k in settings} == settings
    with pytest.raises(ValueError, match="eval_every"):
        resolve_settings(parser.parse_args(["--eval-every", "0"]))


def test_run_time_estimate():
    lab = _lab_module()
    assert lab.evaluations_per_run({"max_steps": 8, "eval_every": 4}) == 3  # steps 0, 4, 8
    assert lab.evaluations_per_run({"max_steps": 10, "eval_every": 4}) == 4  # steps 0, 4, 8, 10
    settings = {"max_steps": 8, "eval_every": 4, "estimate": {"startup_s": 60.0, "step_s": 45.0, "eval_s": 20.0}}
    assert lab.estimate_run_seconds(settings) == 60.0 + 8 * 45.0 + 3 * 20.0


# ---------------------------------------------------------------- summary rules on synthetic logs

def test_spike_rule():
    assert count_spikes([1.0, 1.0, 1.0, 4.0, 1.0, 10.0]) == 2  # steps 4 and 6: > 3 x median 1 of the previous steps
    assert count_spikes([1.0, 10.0, 1.0, 1.0]) == 0  # the jump has fewer than 3 previous steps
    assert count_spikes([1.0, 1.0, 1.0, 3.0]) == 0  # exactly 3 x is not a spike
    assert count_spikes([2.0, 1.0, 3.0, 6.1]) == 1  # median of (2, 1, 3) is 2
    assert count_spikes([1.0, math.nan, 1.0]) == 1  # non-finite counts


def test_reward_auc_and_mean_std():
    assert reward_auc([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.25, abs=1e-12)
    assert math.isnan(reward_auc([]))
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0, 3)
    mean, std, n = mean_std([0.5, math.nan])
    assert (mean, n) == (0.5, 1) and math.isnan(std)
    assert format_mean_std([1.0, 2.0, 3.0], ".2f") == "2.00 ± 1.00"
    assert format_mean_std([0.5]) == "0.500"
    assert format_mean_std([]) == "n/a"


def _history(rewards, grad_norms=None, k3=None, na=None, pa=None, conc=None, loss=0.1):
    out = []
    for i, reward in enumerate(rewards):
        record = {"step": i + 1, "reward": reward, "loss": loss, "grad_norm": (grad_norms or [1.0] * len(rewards))[i],
                  "triage/k3_kl": (k3 or [0.01 * (i + 1) for _ in rewards])[i]}
        for key, values in (("triage/tail_count_NA", na), ("triage/tail_count_PA", pa),
                            ("triage/tail_concentration", conc)):
            if values is not None:
                record[key] = values[i]
        out.append(record)
    out.append({"step": len(rewards), "train_loss": 0.1, "train_runtime": 1.0})  # TRL's end-of-training record
    return out


def _held_out(*accuracies):
    return [{"step": 4 * i, "accuracy": a, "correct": int(a * 8), "total": 8} for i, a in enumerate(accuracies)]


def test_cost_gain_stability_hand_computed():
    from triage_trl.lab.metrics import cost_gain_stability

    def run(seed, step0, final, scores0=None, scores1=None, k3=None, rewards=None, probe=None):
        held = [{"step": 0, "outcomes": step0}, {"step": 20, "outcomes": final}]
        if scores0 is not None:
            held[0]["item_scores"], held[1]["item_scores"] = scores0, scores1
        rewards = rewards or [0.5] * 20
        return {"seed": seed, "held_out": held, "history": _history(rewards, k3=k3),
                "probe": [{"step": s, "k3": v} for s, v in (probe or [])]}

    k3 = [0.01 * math.exp(0.1 * i) for i in range(20)]  # ln k3 rises 0.1 per step
    runs = [run(0, [1, 0, 0, 1], [1, 1, 0, 1], [0.5, 0.0, 0.25, 1.0], [0.5, 0.5, 0.25, 1.0], k3=k3,
                probe=[(0, 0.1), (10, 0.1 * math.e)]),
            run(1, [1, 0, 0, 1], [1, 1, 1, 0], [0.5, 0.0, 0.25, 1.0], [0.75, 0.0, 0.25, 1.0], k3=k3,
                rewards=[0.8] * 10 + [0.4] * 10)]
    reference = [run(0, [1, 1, 0, 1], [1, 1, 1, 1])]
    result = cost_gain_stability(runs, reference, samples_key="avg_at_4")
    # cost: both seeds against the reference's step 0 (seed 1 falls back to the first reference seed): 1 item each
    assert result["cost"]["mean"] == pytest.approx(2 / 8) and result["cost"]["n"] == 8
    assert result["gain"]["mean"] == pytest.approx((1 + 1 + 1 - 1) / 8)  # paired over (seed, item)
    assert result["gain_sampled"]["mean"] == pytest.approx((0.5 + 0.25) / 8)
    assert result["gain"]["low"] <= result["gain"]["mean"] <= result["gain"]["high"]
    assert result["gain_learner"]["n"] == 0 and math.isnan(result["gain_learner"]["mean"])  # no learner records
    runs[0]["held_out"][0]["learner_outcomes"], runs[0]["held_out"][1]["learner_outcomes"] = [0, 0, 1, 1], [1, 1, 1, 0]
    learner = cost_gain_stability(runs[:1], reference)["gain_learner"]
    assert learner["mean"] == pytest.approx((1 + 1 + 0 - 1) / 4) and learner["n"] == 4
    assert result["k3_slope"] == pytest.approx(0.1) and result["probe_k3_slope"] == pytest.approx(0.1)
    # k3 grows e^0.1 per step: e^1.0 = 2.7 x the first-10 mean at step 20 is below 5x; the reward of seed 1 drops
    # 0.4 below its peak for good
    assert [c["collapsed"] for c in result["collapses"]] == [False, True]
    assert result["collapses"][1]["reason"] == "reward"
    none = cost_gain_stability([{"seed": 0, "held_out": [], "history": [], "probe": []}], None)
    assert math.isnan(none["cost"]["mean"]) and math.isnan(none["gain"]["mean"]) and none["gain"]["n"] == 0


def test_collapse_rule():
    history = _history([0.1, 0.2])
    assert collapsed("ok", history, _held_out(0.5, 0.25))  # 0.25 <= 0.5 x 0.5
    assert not collapsed("ok", history, _held_out(0.5, 0.3))
    assert not collapsed("ok", history, _held_out(0.0, 0.0))  # step-0 accuracy 0: the ratio test does not apply
    assert collapsed("failed: StaleSamplerError: gap", history, _held_out(0.5, 0.5))
    assert collapsed("ok", _history([0.1, math.nan]), _held_out(0.5, 0.5))
    assert collapsed("ok", _history([0.1, 0.2], loss=math.inf), _held_out(0.5, 0.5))


def test_run_metrics():
    history = _history([0.2, 0.4, 0.6, 0.8], grad_norms=[1.0, 1.0, 1.0, 5.0], k3=[0.1, 0.3, 0.2, 0.05])
    summary = {"status": "ok", "held_out": _held_out(0.25, 0.5, 0.375), "wall_seconds": 90.0}
    m = run_metrics(summary, history)
    assert m == {"step0_acc": 0.25, "final_acc": 0.375, "best_acc": 0.5, "reward_auc": pytest.approx(0.5, abs=1e-12),
                 "k3_first": 0.1, "k3_mean": pytest.approx(0.1625), "k3_max": 0.3, "k3_final": 0.05, "spikes": 1,
                 "collapsed": False, "failed": False,
                 "non_finite": False, "wall_min": 1.5, "steps": 4, "rollouts": 4}
    # two policy updates per rollout: a reward on every other optimizer step
    two = [dict(h) for h in history]
    for h in two[1::2]:
        del h["reward"]
    assert {k: run_metrics(summary, two)[k] for k in ("steps", "rollouts")} == {"steps": 4, "rollouts": 2}


def test_observations_numbers():
    seeds = [_history([0.1] * 6, na=[4, 3, 2, 1, 0, 0], pa=[0, 1, 1, 1, 2, 2], conc=[0.5] * 6),
             _history([0.1] * 6, na=[6, 5, 2, 1, 0, 0], pa=[2, 1, 1, 1, 2, 2], conc=[0.7] * 6)]
    obs = observations(seeds, first_steps=3)
    assert obs["per_step"][0] == {"step": 1, "NA": 5.0, "PA": 1.0, "concentration": pytest.approx(0.6)}
    assert (obs["na_first"], obs["pa_first"], obs["first_steps"]) == (5.0 + 4.0 + 2.0, 1.0 + 1.0 + 1.0, 3)
    assert obs["concentration_mean"] == pytest.approx(0.6, abs=1e-12)


# ---------------------------------------------------------------- summary of a synthetic lab folder

def _write_run(lab_dir, config, seed, history, held_out, status="ok", wall=120.0, dose=None):
    run_dir = run_path(str(lab_dir), config, seed, dose)
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "log_history.jsonl"), "w") as f:
        f.writelines(json.dumps(h) + "\n" for h in history)
    with open(os.path.join(run_dir, "run_summary.json"), "w") as f:
        json.dump({"config": config, "dose": dose, "seed": seed, "status": status, "held_out": held_out, "wall_seconds": wall,
                   "settings": {"scale": "synthetic"}}, f)


def test_summarize_synthetic_lab(tmp_path):
    names = list(CONFIGS)
    with open(tmp_path / "lab.json", "w") as f:
        json.dump({"settings": {"scale": "synthetic", "max_steps": 4}, "configs": names, "seeds": [0, 1]}, f)
    for i, name in enumerate(names):
        for seed in (0, 1):
            rewards = [0.1 * (i % 3) + 0.05 * seed + 0.01 * s for s in range(4)]
            _write_run(tmp_path, name, seed,
                       _history(rewards, na=[5, 4, 3, 2], pa=[1, 1, 2, 2], conc=[0.4, 0.5, 0.6, 0.7]),
                       _held_out(0.5, 0.5 + 0.125 * seed))
    _write_run(tmp_path, "nvfp4_naive", 2, _history([0.1, math.nan]), _held_out(0.5), status="failed: ValueError: NaN")
    path = summarize(str(tmp_path))
    with open(path) as f:
        text = f.read()
    table = text.split("\nRules:")[0]  # the results table (the per-run table comes later)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    for name in names:
        assert name in rows, name
    cells = [c.strip() for c in rows["bf16"].split("|")[1:-1]]
    # bf16: seeds 0 and 1, final accuracies 50% and 62.5%, AUCs 0.015 and 0.065, k3 max = final = 0.04, wall 2 min
    assert cells == ["bf16", "2", "56.2 ± 8.8", "56.2 ± 8.8", "0.040 ± 0.035", "0.0400 ± 0.0000",
                     "0.0400 ± 0.0000", "0.0 ± 0.0", "0/2", "0/2", "2.0 ± 0.0"]
    naive = [c.strip() for c in rows["nvfp4_naive"].split("|")[1:-1]]
    assert naive[1] == "3" and naive[8] == "1/3" and naive[9] == "1/3"  # the failed, non-finite seed collapses
    assert "failed: ValueError: NaN" in text and "grad-norm spike" in text and "collapse" in text
    assert "NA share 70.0% of NA + PA" in text  # first 5 steps (4 logged): NA 14, PA 6 on every seed
    assert "## Cost, gain and stability" in text and "collapse (pre-registered)" in text
    gain = next(line for line in text.split("## Cost, gain")[1].splitlines() if line.startswith("| bf16 |"))
    assert "| n/a | n/a | n/a |" in gain  # these synthetic records carry no per-item outcomes
    for png in ("overlay.png", "observations.png"):
        assert os.path.getsize(tmp_path / png) > 10_000, png


def test_dose_report_against_bf16_and_the_goal(tmp_path):
    """bf16 ends at 60% (2 seeds); at dose paper TRIAGE ends at 59.5% (ratio 0.99 >= 0.98, above naive's 40%) with no
    collapse: goal met; at dose stress TRIAGE ends at 40%: ratio 0.667, goal not met."""
    hist = _history([0.5] * 3, na=[3, 2, 1], pa=[1, 1, 1], conc=[0.5] * 3)
    for seed in (0, 1):
        _write_run(tmp_path, "bf16", seed, hist, _held_out(0.6, 0.6))
        _write_run(tmp_path, "nvfp4_naive", seed, hist, _held_out(0.6, 0.4), dose="paper")
        _write_run(tmp_path, "triage", seed, hist, _held_out(0.6, 0.59 + 0.01 * seed), dose="paper")
        _write_run(tmp_path, "triage", seed, hist, _held_out(0.5, 0.4), dose="stress")
    runs = load_runs(str(tmp_path))
    assert list(runs) == ["bf16", "nvfp4_naive@paper", "triage@paper", "triage@stress"]
    paper = dose_report(runs, "paper")
    assert [r["label"] for r in paper["rows"]] == ["bf16", "nvfp4_naive@paper", "triage@paper"]
    assert paper["goal"]["ratio"] == pytest.approx(0.595 / 0.6) and paper["goal"]["met"]
    assert paper["goal"]["over_naive"] == pytest.approx(0.195) and paper["goal"]["collapsed"] == 0
    stress = dose_report(runs, "stress")
    assert stress["goal"]["ratio"] == pytest.approx(0.4 / 0.6) and not stress["goal"]["met"]
    text = open(summarize(str(tmp_path))).read()
    assert "### Dose `paper`" in text and "Goal met: `triage@paper` / bf16 = 0.992" in text
    assert "Goal not met: `triage@stress` / bf16 = 0.667" in text
    assert "| triage@paper | 2 |" in text and "dose `stress`: every decoder linear in NVFP4" in text
    assert os.path.getsize(tmp_path / "observations_paper.png") > 10_000


def test_summarize_refuses_an_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="stability_lab.py"):
        summarize(str(tmp_path))


def test_every_seed_calibrates_on_seed_0s_first_training_prompts():
    from triage_trl.lab.worker import load_datasets

    settings = scale_preset("cpu")
    draws = {seed: load_datasets(settings, seed, calibration_size=4) for seed in (0, 1, 2)}
    train0, held_out0, calibration0 = draws[0]
    assert len(train0) == 256 and len(held_out0) == 128 and len(calibration0) == 4
    assert calibration0["prompt"] == train0["prompt"][:4]
    for seed in (1, 2):
        train, held_out, calibration = draws[seed]
        assert calibration["prompt"] == calibration0["prompt"]
        assert held_out["prompt"] == held_out0["prompt"]
        assert train["prompt"][:4] != train0["prompt"][:4]  # the training draw is the seed's own


def test_worker_records_a_failed_run(tmp_path, monkeypatch):
    from triage_trl.lab.worker import run

    settings = {**scale_preset("smoke"), "scale": "smoke", "model": "/no/such/model", "task": "no_such_task"}
    summary = run("triage", 0, str(tmp_path / "run"), settings)
    assert summary["status"].startswith("failed: FileNotFoundError: Model folder /no/such/model does not exist")
    with open(tmp_path / "run" / "run_summary.json") as f:
        assert json.load(f)["status"] == summary["status"]
    assert "Traceback" in (tmp_path / "run" / "error.txt").read_text()
    (start,) = summary["provenance"]  # one start, recorded before anything could fail
    assert start["from_step"] == 0 and start["triage_trl"] == triage_trl.__version__ and "git_commit" in start


def test_a_resumed_run_lists_every_start(tmp_path, monkeypatch):
    from triage_trl.lab.worker import PROVENANCE, run
    from triage_trl.trainer import checkpoints

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / PROVENANCE).write_text(json.dumps({"from_step": 0, "git_commit": "a" * 40}) + "\n")
    monkeypatch.setattr(checkpoints, "last_complete_checkpoint", lambda d: os.path.join(d, "checkpoint-40"))
    settings = {**scale_preset("smoke"), "scale": "smoke", "model": "/no/such/model", "task": "no_such_task"}
    summary = run("triage", 0, str(run_dir), settings)
    assert [p["from_step"] for p in summary["provenance"]] == [0, 40]
    assert summary["provenance"][0]["git_commit"] == "a" * 40  # the first start's record is kept


def test_published_corrections_name_registered_configurations():
    from triage_trl.lab.configs import PUBLISHED_CORRECTIONS, uncorrected_arm

    for triage, others in PUBLISHED_CORRECTIONS.items():
        assert {triage, *others} <= set(CONFIGS)
        assert {uncorrected_arm(o) for o in others} == {uncorrected_arm(triage)}  # the same engines


# ---------------------------------------------------------------- one smoke lab run, end to end

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_lab_end_to_end(tmp_path, capfd):
    """2 configurations x 1 seed x 1 step on a tiny random Qwen3 (each run its own process and vLLM engine, as the
    lab runs them; the lab's own ``main``, which only plans, launches and summarizes, in this process)."""
    lab_dir = tmp_path / "lab"
    argv = ["--scale", "smoke", "--configs", "nvfp4_naive", "triage", "--seeds", "0", "--output-dir", str(lab_dir)]
    capfd.readouterr()
    assert _lab_module().main(argv) == 0
    assert "[2/2] triage@stress seed 0: ok" in capfd.readouterr().out
    for name in ("nvfp4_naive", "triage"):
        run_dir = run_path(str(lab_dir), name, 0, "stress")
        with open(os.path.join(run_dir, "run_summary.json")) as f:
            summary = json.load(f)
        assert summary["status"] == "ok" and summary["steps"] == 1, summary["status"]
        assert summary["dose"] == "stress" and summary["overrides"]["nvfp4_recipe"] == "all"
        assert [p["from_step"] for p in summary["provenance"]] == [0]  # one start, the code it ran
        assert [r["step"] for r in summary["held_out"]] == [0, 1] and summary["held_out"][0]["total"] == 4
        first = summary["held_out"][0]  # greedy per item beside avg@2 at the training temperature
        assert len(first["outcomes"]) == 4 and sum(first["outcomes"]) == first["correct"]
        assert len(first["item_scores"]) == 4 and first["avg_at_2"] == pytest.approx(sum(first["item_scores"]) / 4)
        with open(os.path.join(run_dir, "fixed_probe.jsonl")) as f:
            probe = [json.loads(line) for line in f]
        assert [r["step"] for r in probe] == [0, 1] and all(math.isfinite(r["k3"]) and r["tokens"] > 0 for r in probe)
        with open(os.path.join(run_dir, "log_history.jsonl")) as f:
            logs = [json.loads(line) for line in f]
        step1 = [h for h in logs if "reward" in h]
        assert [h["step"] for h in step1] == [1] and math.isfinite(step1[0]["triage/k3_kl"])
        assert os.path.getsize(os.path.join(run_dir, "plots", "k3_kl.png")) > 1000
        assert not os.path.exists(os.path.join(run_dir, "_sampler_checkpoint"))
    naive, triage = (json.load(open(os.path.join(run_path(str(lab_dir), n, 0, "stress"), "run_summary.json")))
                     for n in ("nvfp4_naive", "triage"))
    # one step-0 evaluation for both (same starting point): measured by the first, reused by the second
    assert "shared_from" not in naive["held_out"][0] and naive["held_out"][0]["seconds"] > 0
    assert triage["held_out"][0]["shared_from"] == "nvfp4_naive@stress seed 0"
    assert triage["held_out"][0]["outcomes"] == naive["held_out"][0]["outcomes"]
    assert triage["step0_identity"] == naive["step0_identity"]
    text = (lab_dir / "results.md").read_text()
    assert "| nvfp4_naive@stress | 1 |" in text and "| triage@stress | 1 |" in text
    assert (lab_dir / "overlay.png").stat().st_size > 1000
    assert (lab_dir / "observations_stress.png").stat().st_size > 1000
    # resume: a second call (its main, in this process) skips both runs and only summarizes
    capfd.readouterr()
    assert _lab_module().main(argv) == 0 and capfd.readouterr().out.count("done earlier, skipped") == 2


def test_learner_weights_are_scored_only_beside_an_nvfp4_sampler(tmp_path):
    from triage_trl.lab.worker import scores_learner_weights

    settings = {**scale_preset("collapse"), "scale": "collapse"}
    scored = {name: scores_learner_weights(build_trainer_config(name, settings, str(tmp_path / name), 0,
                                                                  settings.get("trainer_overrides"), dose))
              for name, dose in (("bf16", None), ("bf16_learner_nvfp4_sampler", "stress"), ("nvfp4_naive", "stress"),
                                 ("triage", "stress"))}
    assert scored == {"bf16": False, "bf16_learner_nvfp4_sampler": True, "nvfp4_naive": False, "triage": False}


def test_learner_accuracy_scores_the_learner_itself(tiny_qwen3_dir):
    """transformers ``generate`` on the trainer's own model, greedy and sampled, the model's mode restored."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triage_trl.data import reasoning_gym_dataset
    from triage_trl.eval.held_out import HeldOutResult, SampledResult, learner_accuracy

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).train()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    trainer = SimpleNamespace(model=model, processing_class=tokenizer,
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    data = reasoning_gym_dataset(size=5, seed=3)
    greedy = learner_accuracy(trainer, data, 6, batch_size=2)
    assert isinstance(greedy, HeldOutResult) and greedy.total == 5 and len(greedy.completions) == 5
    # deterministic (the same batches; other batch sizes change GEMM shapes, and a random model's near-ties with them)
    assert greedy.completions == learner_accuracy(trainer, data, 6, batch_size=2).completions
    assert model.training
    sampled = learner_accuracy(trainer, data, 6, n=3, temperature=1.0, batch_size=2)
    assert isinstance(sampled, SampledResult) and len(sampled.item_scores) == 5 and sampled.n == 3
    assert all(s in (0.0, 1 / 3, 2 / 3, 1.0) for s in sampled.item_scores)
    with pytest.raises(ValueError, match="n == 1 when greedy"):
        learner_accuracy(trainer, data, 6, n=2)
    import torch

    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    learner_accuracy(trainer, data, 6, n=2, temperature=1.0, batch_size=2)
    assert torch.equal(torch.rand(3), expected)  # the process's random stream (an in-process sampler's) is untouched
    from triage_trl.eval.backends import TransformersBackend

    with pytest.raises(ValueError, match="would need a conversion"):
        TransformersBackend(None, precision="nvfp4", tokenizer=tokenizer, model=model)
    sharded = SimpleNamespace(**vars(trainer), is_fsdp_enabled=True)
    with pytest.raises(NotImplementedError, match="single process or under DDP"):
        learner_accuracy(sharded, data, 6)


def test_a_stored_step0_record_without_the_learner_scores_is_not_reused_by_a_run_that_needs_them(tmp_path):
    from triage_trl.lab.step0 import read_step0, write_step0

    write_step0(str(tmp_path), "abc", {"step": 0, "outcomes": [1, 0]}, "bf16 seed 0")
    assert read_step0(str(tmp_path), "abc")["shared_from"] == "bf16 seed 0"
    assert read_step0(str(tmp_path), "abc", learner=True) is None
    write_step0(str(tmp_path), "abc", {"step": 0, "outcomes": [1, 0], "learner_outcomes": [1, 1]}, "x seed 0")
    assert read_step0(str(tmp_path), "abc", learner=True)["learner_outcomes"] == [1, 1]
    assert read_step0(str(tmp_path), "missing") is None


def test_the_fixed_probe_calibrates_the_hot_dose_on_its_fixed_text(tiny_qwen3_dir, tmp_path):
    """E3: the dose on the probe's tokens is the learner at T against itself at factor x T (one forward), 0 at
    factor 1, growing with the factor; the probe records it beside the engines' k3 at the next rollout's factor."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from triage_trl.lab.hot_sampler import ramp
    from triage_trl.lab.probe import FixedProbe, learner_logps, pad_batch, temperature_dose

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    batch = pad_batch([[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14, 15]], pad_token_id=0)
    assert temperature_dose(model, batch, 1.0, 1.0) == {"k3": 0.0, "gap_mean": 0.0, "p99_abs_gap": 0.0}
    doses = [temperature_dose(model, batch, 0.7, f)["k3"] for f in (1.15, 1.3)]
    assert 0 < doses[0] < doses[1]
    # the same number from two separate forwards, by hand
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    cold, hot = (learner_logps(model, ids, att, 4, t) for t in (0.7, 0.7 * 1.3))
    gap = (cold - hot)[batch["completion_mask"].bool()].double()
    assert doses[1] == pytest.approx(float((torch.expm1(gap) - gap).mean()), rel=1e-6)

    records = []
    probe = FixedProbe(_Rows(2), every=5, max_tokens=4, temperature=0.7,
                       on_result=records.append, sampler_factor=lambda step: ramp(step + 1, 10, 1.0, 1.3))
    trainer = SimpleNamespace(model=model, sync_sampler=lambda: None,
                              vllm_generation=SimpleNamespace(score_logps=lambda seqs, temperature: [
                                  [-1.0] * (len(s) - 1) for s in seqs]))
    probe.trainer, probe.batch = trainer, batch
    record = probe.measure(9)
    assert record["dose_factor"] == pytest.approx(1.3)
    # the worker's factor is the one HotSampler sets for the next step (its temperatures / the base temperature)
    from triage_trl.lab.hot_sampler import HotSampler
    from triage_trl.lab.worker import start_fixed_probe

    hot = HotSampler(SimpleNamespace(args=SimpleNamespace(temperature=0.7),
                                     vllm_generation=SimpleNamespace(temperature=0.7)), 1.0, 1.3)
    for step in range(10):
        hot.on_step_begin(None, SimpleNamespace(global_step=step, max_steps=10), None)
    from triage_trl.lab.worker import FIXED_PROBE_BATCH

    torch.save(batch, tmp_path / FIXED_PROBE_BATCH)  # a resumed run re-scores its saved completions
    added = []
    wired = SimpleNamespace(add_callback=added.append, model=model, sync_sampler=lambda: None,
                            vllm_generation=trainer.vllm_generation)
    worker_probe = start_fixed_probe(wired, _Rows(2), {"probe_every": 5, "max_completion_length": 4,
                                                       "temperature": 0.7, "max_steps": 10},
                                     str(tmp_path), resumed=True, hot=(1.0, 1.3))
    assert added == [worker_probe] and torch.equal(worker_probe.batch["completion_ids"], batch["completion_ids"])
    # the record at step s (on_step_end, global_step s): the factor HotSampler sets at the next on_step_begin
    # (global_step still s), its temperatures[s]
    for step in range(10):
        assert worker_probe.sampler_factor(step) == pytest.approx(hot.temperatures[step] / 0.7)
    assert record["dose_k3"] == pytest.approx(doses[1])
    assert records == [record] and record["tokens"] == 6 and math.isfinite(record["k3"])


class _Rows:
    """A stand-in for a datasets.Dataset of ``n`` rows (FixedProbe only selects from it before capture)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def select(self, indices):
        return self


def test_summary_reports_the_hot_dose_calibrated_on_the_fixed_probe(tmp_path):
    hist = _history([0.5] * 3, na=[3, 2, 1], pa=[1, 1, 1], conc=[0.5] * 3)
    for seed, last in ((0, 0.02), (1, 0.04)):
        _write_run(tmp_path, "triage", seed, hist, _held_out(0.6, 0.6), dose="hot_1.3")
        with open(os.path.join(run_path(str(tmp_path), "triage", seed, "hot_1.3"), "fixed_probe.jsonl"), "w") as f:
            for record in ({"step": 0, "k3": 1e-10, "dose_factor": 1.0, "dose_k3": 0.0},
                           {"step": 3, "k3": 2e-10, "dose_factor": 1.3, "dose_k3": last}):
                f.write(json.dumps(record) + "\n")
    _write_run(tmp_path, "triage", 0, hist, _held_out(0.6, 0.6), dose="stress")  # no hot sampler: no calibration
    # a third seed that stopped early: the ends are the first and last steps every seed recorded
    _write_run(tmp_path, "nvfp4_naive", 0, hist, _held_out(0.6, 0.6), dose="hot_1.3")
    _write_run(tmp_path, "nvfp4_naive", 1, hist, _held_out(0.6, 0.6), dose="hot_1.3")
    for seed, records in ((0, [(0, 1.0, 0.0), (3, 1.1, 0.01), (6, 1.3, 0.05)]), (1, [(0, 1.0, 0.0), (3, 1.1, 0.03)])):
        with open(os.path.join(run_path(str(tmp_path), "nvfp4_naive", seed, "hot_1.3"), "fixed_probe.jsonl"), "w") as f:
            for step, factor, k3 in records:
                f.write(json.dumps({"step": step, "k3": 1e-10, "dose_factor": factor, "dose_k3": k3}) + "\n")
    text = open(summarize(str(tmp_path))).read()
    hot = text.split("### Dose `hot_1.3`")[1].split("###")[0]
    assert "- `triage@hot_1.3`: 0.0000 (x1.00, step 0) -> 0.0300 (x1.30, step 3), 2 seed(s)" in hot
    assert "- `nvfp4_naive@hot_1.3`: 0.0000 (x1.00, step 0) -> 0.0200 (x1.10, step 3), 2 seed(s)" in hot
    assert "Calibration on the fixed probe" not in text.split("### Dose `stress`")[1].split("###")[0]
    # E3's k3 rises by design: its collapse count is by reward or grad norm (docs/stability.md)
    rows = {line.split(" | ")[0][2:]: line for line in text.split("## Cost, gain and stability")[1].split("\n## ")[0].splitlines()
            if line.startswith("| ") and "@" in line}
    assert rows["triage@hot_1.3"].endswith("| 0/2 by reward or grad norm |")
    assert rows["triage@stress"].endswith("| 0/1 |")


def test_a_correction_is_measured_against_its_uncorrected_arm_paired_by_item(tmp_path):
    from triage_trl.lab.configs import uncorrected_arm
    from triage_trl.lab.metrics import gain_difference

    assert [uncorrected_arm(n) for n in ("triage", "nvfp4_opsm", "direction_blind", "triage_no_repair")] \
        == ["nvfp4_naive"] * 4
    assert [uncorrected_arm(n) for n in ("bf16_learner_tis", "bf16_learner_opsm", "bf16_learner_triage")] \
        == ["bf16_learner_nvfp4_sampler"] * 3
    assert [uncorrected_arm(n) for n in ("bf16", "nvfp4_naive", "bf16_learner_nvfp4_sampler")] == [None] * 3

    def arm(seed, step0, final, **extra):
        first, last = {"step": 0, "outcomes": step0}, {"step": 100, "outcomes": final}
        for key, (a, b) in extra.items():
            first[key], last[key] = a, b
        return {"seed": seed, "held_out": [first, last]}

    # seed 0: items gain (1, 0, -1, 0) vs (0, 0, 0, 1) -> differences (1, 0, -1, -1); seed 1 only in the run
    runs = [arm(0, [0, 1, 1, 0], [1, 1, 0, 0]), arm(1, [0, 0, 0, 0], [1, 1, 1, 1])]
    reference = [arm(0, [0, 1, 1, 0], [0, 1, 1, 1])]
    diff = gain_difference(runs, reference)
    assert (diff["mean"], diff["n"]) == (-0.25, 4) and diff["low"] <= -0.25 <= diff["high"]
    assert gain_difference(runs, reference, "learner_outcomes")["n"] == 0  # no such records: n/a, not 0
    with pytest.raises(ValueError, match="same held-out items"):
        gain_difference(runs, [arm(0, [0, 1], [1, 1])])

    # in the summary: triage and OPSM against naive at the same dose; the bf16-learner arm's learner scores too
    def write(config, dose, final, learner_final=None):
        held = [{"step": 0, "accuracy": 0.5, "outcomes": [0, 1, 0, 1]},
                {"step": 4, "accuracy": sum(final) / 4, "outcomes": final}]
        if learner_final is not None:
            held[0]["learner_outcomes"], held[1]["learner_outcomes"] = [1, 1, 0, 0], learner_final
        _write_run(tmp_path, config, 0, _history([0.5] * 4), held, dose=dose)

    write("nvfp4_naive", "stress", [0, 1, 0, 1])
    write("triage", "stress", [1, 1, 1, 1])
    write("nvfp4_opsm", "stress", [0, 0, 0, 1])
    write("bf16_learner_nvfp4_sampler", "stress", [0, 1, 0, 1], learner_final=[1, 1, 0, 0])
    write("bf16_learner_triage", "stress", [0, 1, 0, 1], learner_final=[1, 1, 1, 0])
    text = open(summarize(str(tmp_path))).read()
    section = text.split("## Corrections against their uncorrected arm")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in section.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["triage@stress"][:2] == ["nvfp4_naive@stress", "1"] and rows["triage@stress"][2].startswith("+50.0 [")
    assert rows["nvfp4_opsm@stress"][2].startswith("-25.0 [") and rows["nvfp4_opsm@stress"][4] == "n/a"
    assert rows["bf16_learner_triage@stress"][:3] == ["bf16_learner_nvfp4_sampler@stress", "1", "+0.0 [+0.0, +0.0]"]
    assert rows["bf16_learner_triage@stress"][4].startswith("+25.0 [")
    assert "nvfp4_naive@stress" not in rows and "bf16_learner_nvfp4_sampler@stress" not in rows
    # head to head: TRIAGE (4/4 at the end) against OPSM (1/4) on the same engines and dose; no TIS run, no row
    section = text.split("## TRIAGE against the published corrections")[1].split("\n## ")[0]
    head = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
            if line.startswith("| ") and "---" not in line and not line.startswith("| run ")]
    assert len(head) == 1 and head[0][:3] == ["triage@stress", "nvfp4_opsm@stress", "1"]
    assert head[0][3].startswith("+75.0 [") and head[0][4] == "n/a"


def test_a_held_out_evaluation_leaves_the_training_random_stream_as_it_found_it(monkeypatch):
    """An evaluation that draws from every generator (as vLLM's sampler draws unseeded requests from torch's) leaves
    them where they were: a run that measures its step-0 evaluation and one that reuses it roll out alike."""
    import random
    from types import SimpleNamespace

    import numpy as np
    import torch

    from triage_trl.eval import held_out
    from triage_trl.eval.held_out import HeldOutResult
    from triage_trl.runs import HeldOutEvaluator

    def drawing_accuracy(trainer, dataset, max_tokens):
        torch.rand(100), random.random(), np.random.rand(3)
        return HeldOutResult(correct=1, total=2, outcomes=[True, False], completions=["a", "b"])

    monkeypatch.setattr(held_out, "greedy_accuracy", drawing_accuracy)
    trainer = SimpleNamespace(sync_sampler=lambda: torch.rand(7),
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
    evaluator = HeldOutEvaluator([{"prompt": "x"}] * 2, max_tokens=4)

    def next_draws():
        return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    measured = evaluator.evaluate(trainer, 0)
    after_measuring = next_draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    evaluator.reuse({"step": 0, "accuracy": 0.5})
    assert measured.accuracy == 0.5 and next_draws() == after_measuring


def test_the_overlay_marks_e3_collapses_by_reward_or_grad_norm_only():
    from triage_trl.lab.summarize import _collapse_step

    verdict = {"collapsed": True, "reason": "k3", "step": 35, "criteria": {"k3": 35, "reward": 60}}
    assert _collapse_step("nvfp4_naive@hot_1.3", verdict) == 60  # k3 rises by design at a hot-sampler dose
    assert _collapse_step("nvfp4_naive@stress", verdict) == 35
    assert _collapse_step("triage@hot_1.15", {"collapsed": True, "reason": "k3", "step": 31,
                                              "criteria": {"k3": 31}}) is None
