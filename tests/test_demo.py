"""The demo (``make demo``): a 2-step run on the real SmolLM2-135M-Instruct, NVFP4 sampler and learner (slow)."""

from __future__ import annotations

import json
import math
import os

import pytest

from triage_trl.demo import DEMO_DEFAULTS, QUICK, format_table, main


def test_unknown_setting_is_refused():
    from triage_trl.demo import run_demo

    with pytest.raises(ValueError, match="max_steps"):
        run_demo("unused", nope=1)


def test_lora_config_of_the_demo():
    from triage_trl.demo import lora_config

    assert lora_config(0) is None
    config = lora_config(16)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.target_modules) == (16, 32, 0.0, "all-linear")
    with pytest.raises(ValueError, match="full fine-tuning"):
        lora_config(-1)


def test_table_lists_before_after_steps_time():
    summary = {"accuracy_before": 0.25, "accuracy_after": 0.5, "correct_before": 2, "correct_after": 4,
               "standard_error_before": 0.153, "standard_error_after": 0.177, "accuracy_gain": 0.25,
               "accuracy_gain_se": 0.164, "items_won": 3, "items_lost": 1, "held_out_in_train": 5,
               "held_out": 8, "steps": 2, "train_seconds": 60.0, "total_seconds": 120.0, "reward_first": 0.1,
               "reward_last": 0.2, "zero_signal_frac": 0.5, "sync_probe_gap_max": 0.9,
               "settings": {"nvfp4_recipe": "paper", "lora_rank": 16, "learning_rate": 1e-4},
               "mismatch_first": {"step": 0, "gap_abs_mean": 0.3, "k3_kl": 0.1, "amp_imbalance": 1.0, "repaired_frac": 0.0},
               "mismatch_last": {"step": 1, "gap_abs_mean": 0.3, "k3_kl": 0.1, "amp_imbalance": 1.0, "repaired_frac": 0.0}}
    table = format_table(summary)
    assert "all (full fine-tuning), learning rate 1e-05" in format_table(
        {**summary, "settings": {"lora_rank": 0, "learning_rate": 1e-5}})
    for text in ("25.0% ± 15.3% (2/8)", "50.0% ± 17.7% (4/8)", "+25.0% ± 16.4% (items won 3, lost 1)",
                 "held-out questions also among the training items  5/8", "1.0 min", "2.0 min", "paper",
                 "LoRA rank 16 on every decoder linear, learning rate 0.0001",
                 "triage/k3_kl step 0 -> 1"):
        assert text in table
    assert set(QUICK) <= set(DEMO_DEFAULTS)


@pytest.mark.slow
def test_quick_demo_run(smollm2_dir, tmp_path, capfd):
    out = str(tmp_path / "demo")
    summary = main(["--output-dir", out, "--quick"])
    assert summary["steps"] == QUICK["max_steps"] == 2
    assert summary["held_out"] == QUICK["eval_size"]
    for key in ("accuracy_before", "accuracy_after"):
        assert 0.0 <= summary[key] <= 1.0
    won, lost = summary["items_won"], summary["items_lost"]
    assert summary["accuracy_gain"] == pytest.approx((won - lost) / summary["held_out"])
    assert 0 <= summary["held_out_in_train"] <= summary["held_out"]
    assert 0 <= summary["sync_probe_gap_max"] < 2.0 and math.isfinite(summary["mismatch_last"]["k3_kl"])
    assert summary["sync_probes"] >= 3  # the quick run probes every sync: the ones after its updates too
    weights = ("adapter_model.safetensors", "adapter_config.json") if summary["settings"]["lora_rank"] \
        else ("model.safetensors",)
    for name in (*weights, "README.md", "trainer_state.json", "demo_summary.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "README.md")) as f:
        assert "## TRIAGE" in f.read()
    with open(os.path.join(out, "trainer_state.json")) as f:
        logs = [h for h in json.load(f)["log_history"] if "triage/k3_kl" in h]
    assert [h["step"] for h in logs] == [1, 2]
    assert {"reward.png", "k3_kl.png", "quadrant_fractions.png", "weight_range.png"} <= set(summary["plots"])
    assert all(os.path.getsize(os.path.join(out, "plots", p)) > 1000 for p in summary["plots"])
    printed = capfd.readouterr().out
    assert "held-out accuracy before (greedy)" in printed and "optimizer steps" in printed


def test_an_earlier_run_is_moved_aside_not_mixed_or_deleted(tmp_path, capsys):
    from triage_trl.demo import _move_earlier_run_aside

    out = tmp_path / "demo"
    assert _move_earlier_run_aside(str(out)) is None  # nothing there yet
    out.mkdir()
    (out / "trainer_state.json").write_text("{}")
    assert _move_earlier_run_aside(str(out)) == f"{out}.previous-1"
    assert not out.exists() and (tmp_path / "demo.previous-1" / "trainer_state.json").read_text() == "{}"
    out.mkdir()
    (out / "trainer_state.json").write_text("[]")
    assert _move_earlier_run_aside(str(out)) == f"{out}.previous-2"
    assert "moved to" in capsys.readouterr().out
