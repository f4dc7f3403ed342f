"""Checkpoints a kill cannot leave half-written, and resuming from the last complete one
(``triage_trl.trainer.checkpoints``): a real training process killed (SIGKILL) inside a checkpoint save, then
resumed."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from triage_trl.runtime import child_process_env
from triage_trl.runtime.run_folder import LOCK_NAME
from triage_trl.trainer.checkpoints import (
    PARTIAL_PREFIX,
    last_complete_checkpoint,
    remove_partials,
    resolve_resume,
)

WORKER = Path(__file__).with_name("checkpoint_worker.py")


def _checkpoint(run: Path, step: int, complete: bool = True) -> Path:
    path = run / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        (path / "trainer_state.json").write_text("{}")
    return path


def test_resume_true_skips_an_incomplete_checkpoint_with_a_warning(tmp_path, caplog):
    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2, complete=False)
    with caplog.at_level(logging.WARNING, logger="triage_trl.trainer.checkpoints"):
        assert resolve_resume(True, tmp_path) == str(tmp_path / "checkpoint-1")
        assert resolve_resume("true", tmp_path) == str(tmp_path / "checkpoint-1")
    assert "checkpoint-2: it has no trainer_state.json" in caplog.text


def test_resume_from_a_path(tmp_path, caplog):
    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 3)
    _checkpoint(tmp_path, 5, complete=False)
    assert resolve_resume(str(tmp_path / "checkpoint-1"), tmp_path / "other") == str(tmp_path / "checkpoint-1")
    with caplog.at_level(logging.WARNING, logger="triage_trl.trainer.checkpoints"):
        assert resolve_resume(str(tmp_path / "checkpoint-5"), "unused") == str(tmp_path / "checkpoint-3")
    assert "checkpoint-5 is incomplete" in caplog.text
    assert resolve_resume(str(tmp_path), "unused") == str(tmp_path / "checkpoint-3")  # a run folder
    assert resolve_resume(None, tmp_path) is None and resolve_resume(False, tmp_path) is None


def test_resume_without_a_complete_checkpoint_names_the_fix(tmp_path):
    _checkpoint(tmp_path, 2, complete=False)
    with pytest.raises(ValueError, match="No complete checkpoint .* start a new run"):
        resolve_resume(True, tmp_path)
    with pytest.raises(ValueError, match="No complete checkpoint for resume_from_checkpoint"):
        resolve_resume(str(tmp_path / "checkpoint-2"), tmp_path)
    assert last_complete_checkpoint(tmp_path / "missing") is None


def test_remove_partials_keeps_checkpoints(tmp_path):
    _checkpoint(tmp_path, 1)
    (tmp_path / f"{PARTIAL_PREFIX}checkpoint-2" / "checkpoint-2").mkdir(parents=True)
    remove_partials(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode} before hanging: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("worker never reached the save")
        time.sleep(0.5)


@pytest.mark.slow
def test_kill_during_a_save_then_resume_continues_from_the_last_complete_checkpoint(tmp_path, tiny_qwen3_dir):
    run = tmp_path / "run"
    env = child_process_env(PYTHONPATH=os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(WORKER), tiny_qwen3_dir, str(run), "3"]
    proc = subprocess.Popen([*cmd, "--hang-at", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    _wait_for(tmp_path / "hanging", proc)
    os.kill(proc.pid, signal.SIGKILL)  # inside the save of step 2: model and optimizer written, trainer state not
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    staged = (tmp_path / "hanging").read_text()
    assert Path(staged).parent.name == f"{PARTIAL_PREFIX}checkpoint-2"  # written aside, not into checkpoint-2
    assert (run / f"{PARTIAL_PREFIX}checkpoint-2" / "checkpoint-2" / "optimizer.pt").is_file()
    assert not (run / "checkpoint-2").exists()
    assert (run / "checkpoint-1" / "trainer_state.json").is_file()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == proc.pid  # the dead run's lock is still there

    done = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"resumed_from": str(run / "checkpoint-1"), "global_step": 3}
    assert f"taking over the lock of run PID {proc.pid}" in done.stderr
    assert f"Removing {run / (PARTIAL_PREFIX + 'checkpoint-2')}" in done.stderr
    names = sorted(p.name for p in run.iterdir() if p.name.startswith(("checkpoint", ".partial")))
    assert names == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for step in (2, 3):
        state = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert state["global_step"] == step
    assert not (run / LOCK_NAME).exists()  # released at exit


@pytest.mark.slow
def test_save_total_limit_rotates_the_renamed_checkpoints(tmp_path, tiny_qwen3_dir):
    import torch
    from datasets import Dataset

    from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer

    run = tmp_path / "run"
    args = TriageGRPOConfig(
        output_dir=str(run), triage_mode="off", use_vllm=False, use_cpu=True, bf16=False, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, report_to="none", save_strategy="steps", save_steps=1,
        save_total_limit=2, max_steps=3, model_init_kwargs={"dtype": torch.float32},
    )
    trainer = TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=lambda completions, **kw: [1.0] * len(completions),
                                args=args, train_dataset=Dataset.from_dict({"prompt": ["What is 1 + 1?\n"] * 12}))
    trainer.train()
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint-2", "checkpoint-3"]
    assert trainer.args.save_total_limit == 2
    assert "_get_output_dir" not in vars(trainer)  # the staging redirection is undone
