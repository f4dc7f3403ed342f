"""triage-report: PNG plots from a run's log history (synthetic trainer logs, and a real tiny run's output)."""

from __future__ import annotations

import json
import os

import pytest

from triage_trl import METRIC_NAMES
from triage_trl.report import FIGURES, figure_series, main, write_plots
from triage_trl.runtime.run_logs import read_log_history

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_state(run_dir, history):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "trainer_state.json"), "w") as f:
        json.dump({"log_history": history, "global_step": len(history)}, f)


def _history(steps=3):
    history = []
    for step in range(1, steps + 1):
        record = {"step": step, "epoch": step / steps, "reward": 0.1 * step, "reward_std": 0.3,
                  "rewards/accuracy_reward/mean": 0.1 * step, "rewards/format_reward/mean": 1.0}
        record.update({f"triage/{name}": 0.01 * step for name in METRIC_NAMES})
        history.append(record)
    history.append({"step": steps, "train_runtime": 1.0, "train_loss": 0.0})  # the final summary record
    return history


def _is_png(path):
    with open(path, "rb") as f:
        return os.path.getsize(path) > 1000 and f.read(8) == PNG_MAGIC


def test_every_figure_from_a_triage_log(tmp_path, capsys):
    run = str(tmp_path / "run")
    _write_state(run, _history())
    history = read_log_history(run)
    assert len(history) == 4
    data = {name: figure_series(history, name) for name in FIGURES}
    assert set(data["reward"]) == {"reward (weighted sum)", "reward std", "accuracy_reward", "format_reward"}
    assert data["reward"]["reward (weighted sum)"] == ([1, 2, 3], [0.1, 0.2, pytest.approx(0.3)])
    assert set(data["quadrant_fractions"]) == {"NA", "PA", "NC", "PC"}
    assert set(data["weight_range"]) == {"min", "mean", "max"}
    assert data["k3_kl"]["k3 KL"] == ([1, 2, 3], [0.01, 0.02, 0.03])
    for name in ("tail_imbalance", "tail_concentration", "hot_segment_fraction"):
        assert data[name], name
    paths = main([run])
    assert [os.path.basename(p) for p in paths] == [f"{name}.png" for name in FIGURES]
    assert all(_is_png(p) for p in paths)
    assert capsys.readouterr().out.split() == paths


def test_triage_off_run_gets_only_the_reward_plot(tmp_path):
    run = str(tmp_path / "off")
    _write_state(run, [{"step": 1, "reward": 0.5, "rewards/f/mean": 0.5}, {"step": 2, "reward": float("nan")}])
    paths = write_plots(run, out_dir=str(tmp_path / "out"))
    assert [os.path.basename(p) for p in paths] == ["reward.png"] and _is_png(paths[0])
    assert figure_series(read_log_history(run), "reward")["reward (weighted sum)"] == ([1], [0.5])


def test_checkpoint_state_and_errors(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        read_log_history(str(tmp_path))
    with pytest.raises(SystemExit) as info:  # the command line says it in one line, no traceback
        main([str(tmp_path)])
    assert info.value.code == 2 and "No log_history.jsonl or trainer_state.json" in capsys.readouterr().err
    for step in (2, 10):
        _write_state(str(tmp_path / f"checkpoint-{step}"), _history(step))
    assert [h["step"] for h in read_log_history(str(tmp_path))][-1] == 10  # the last checkpoint's
    _write_state(str(tmp_path / "empty"), [])
    with pytest.raises(ValueError, match="no training records"):
        write_plots(str(tmp_path / "empty"))


@pytest.mark.slow
def test_report_on_a_real_tiny_run(vllm_trainers, tmp_path):
    """A real TriageGRPOTrainer run (tiny Qwen3, NVFP4 sampler and learner; shared session run)."""
    trainer = vllm_trainers("nvfp4-nvfp4", learner_precision="nvfp4", sampler_precision="nvfp4")
    run = str(tmp_path / "tiny")
    os.makedirs(run)
    trainer.state.save_to_json(os.path.join(run, "trainer_state.json"))
    paths = write_plots(run)
    assert [os.path.basename(p) for p in paths] == [f"{name}.png" for name in FIGURES]
    assert all(_is_png(p) for p in paths)
    history = read_log_history(run)
    assert set(figure_series(history, "quadrant_fractions")) == {"NA", "PA", "NC", "PC"}
    steps, values = figure_series(history, "k3_kl")["k3 KL"]
    assert steps == [1] and values[0] >= 0
