"""The output folder of a run (``triage_trl.runtime.run_folder``): read-only and full folders refused before the model
loads, one live run per folder (a lock), and no new run into a folder that holds one unless it resumes."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest

from triage_trl.runtime import child_process_env, run_folder
from triage_trl.runtime.run_folder import (
    LOCK_NAME,
    OutputFolderError,
    RunLock,
    check_output_dir,
    checkpoint_bytes,
    existing_run,
    model_bytes,
    refuse_existing_run,
)

Usage = namedtuple("Usage", "total used free")


def _read_only(monkeypatch):
    def probe(folder):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(run_folder, "_probe_write", probe)


def _full(monkeypatch, free=10 * 2**20):
    monkeypatch.setattr(run_folder.shutil, "disk_usage", lambda path: Usage(2**40, 2**40 - free, free))


def test_writable_folder_passes_and_missing_folders_check_their_parent(tmp_path):
    check_output_dir(tmp_path / "a" / "b", needed_bytes=1)
    assert not (tmp_path / "a").exists()  # checks create nothing


def test_read_only_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    _read_only(monkeypatch)
    with pytest.raises(OutputFolderError) as info:
        check_output_dir(tmp_path / "run")
    assert str(info.value) == (f"output_dir {tmp_path / 'run'} is on a read-only filesystem: choose a writable "
                               "--output_dir (or fix the folder's permissions).")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder without write permission")
def test_folder_without_write_permission_is_refused(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(OutputFolderError, match="cannot be written"):
            check_output_dir(tmp_path / "run")
    finally:
        tmp_path.chmod(0o755)


def test_full_disk_is_refused_with_sizes(tmp_path, monkeypatch):
    _full(monkeypatch)
    with pytest.raises(OutputFolderError, match=r"has 0.01 GiB free, less than one checkpoint of this model needs "
                                                r"\(at least 3.00 GiB\): free space there"):
        check_output_dir(tmp_path, needed_bytes=checkpoint_bytes(2**30))
    check_output_dir(tmp_path, needed_bytes=2**20)  # fits


def test_a_file_is_not_an_output_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputFolderError, match="is a file, not a folder"):
        check_output_dir(tmp_path / "f")


def test_model_bytes(tmp_path, tiny_qwen3_dir):
    import torch

    weights = os.path.getsize(os.path.join(tiny_qwen3_dir, "model.safetensors"))
    assert model_bytes(tiny_qwen3_dir) == weights
    assert model_bytes(torch.nn.Linear(4, 2)) == (4 * 2 + 2) * 4
    assert model_bytes("org/hub-id") is None
    assert checkpoint_bytes(10) == 30 and checkpoint_bytes(10, save_only_model=True) == 10


def test_lock_refuses_a_second_live_run(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=child_process_env())
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": other.pid, "host": run_folder.socket.gethostname()}))
        with pytest.raises(OutputFolderError, match=f"is in use by run PID {other.pid} .*choose another --output_dir"):
            RunLock(tmp_path).acquire()
        with pytest.raises(OutputFolderError, match="is in use by run PID"):
            RunLock(tmp_path).check()
    finally:
        other.kill()
        other.wait()


def test_stale_lock_of_a_dead_run_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], env=child_process_env(),
                          capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": run_folder.socket.gethostname()}))
    RunLock(tmp_path).check()  # a dead owner does not block
    with caplog.at_level(logging.WARNING, logger="triage_trl.runtime.run_folder"):
        lock = RunLock(tmp_path).acquire()
    assert f"taking over the lock of run PID {pid}" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert RunLock(tmp_path).acquire().held  # the same process (a second trainer in a notebook) keeps it
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    lock.release()  # idempotent


def test_concurrent_acquire_has_one_winner(tmp_path):
    code = ("import sys, time; from triage_trl.runtime.run_folder import RunLock, OutputFolderError\n"
            "try:\n    RunLock(sys.argv[1]).acquire(); print('won', flush=True); time.sleep(20)\n"
            "except OutputFolderError:\n    print('refused', flush=True)\n")
    env = child_process_env(PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    lines = sorted(p.stdout.readline().strip() for p in procs)
    for p in procs:
        p.kill()
        p.wait()
    assert lines == ["refused", "won"]


def test_new_run_into_a_folder_holding_one_is_refused_unless_resuming(tmp_path):
    assert existing_run(tmp_path / "missing") == []
    refuse_existing_run(tmp_path, None)
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "trainer_state.json").write_text("{}")
    (tmp_path / "tiny-qwen3").mkdir()
    assert existing_run(tmp_path) == ["checkpoint-2", "trainer_state.json"]
    with pytest.raises(OutputFolderError, match=r"already holds a run \(checkpoint-2, trainer_state.json\): resume it "
                                                "with --resume_from_checkpoint true, or choose a new --output_dir"):
        refuse_existing_run(tmp_path, None)
    refuse_existing_run(tmp_path, True)
    refuse_existing_run(tmp_path, str(tmp_path / "checkpoint-2"))


# --- in the trainer: refused before TRL's constructor (which loads the model) runs ---
def _args(tmp_path, **overrides):
    import torch

    from triage_trl.trainer import TriageGRPOConfig

    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                  num_generations=4, max_completion_length=4, report_to="none", save_strategy="no",
                  triage_mode="off", use_vllm=False, model_init_kwargs={"dtype": torch.float32}, max_steps=1)
    kwargs.update(overrides)
    return TriageGRPOConfig(**kwargs)


@pytest.fixture
def no_model_load(monkeypatch):
    import trl

    def refuse(*a, **kw):
        raise AssertionError("TRL's constructor ran: the model would load")

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", refuse)


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"What is {i} + {i}?\n" for i in range(4)]})


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("fault", ["read_only", "full"])
def test_trainer_refuses_read_only_and_full_folders_before_the_model_loads(tmp_path, monkeypatch, tiny_qwen3_dir,
                                                                          no_model_load, fault):
    from triage_trl.trainer import TriageGRPOTrainer

    _read_only(monkeypatch) if fault == "read_only" else _full(monkeypatch, free=1000)
    match = "read-only filesystem" if fault == "read_only" else "less than one checkpoint of this model needs"
    with pytest.raises(OutputFolderError, match=match):
        TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward, args=_args(tmp_path), train_dataset=_dataset())
    assert not (tmp_path / "run").exists()


def test_trainer_refuses_a_folder_a_live_run_holds(tmp_path, tiny_qwen3_dir, no_model_load):
    from triage_trl.trainer import TriageGRPOTrainer

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=child_process_env())
    try:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / LOCK_NAME).write_text(json.dumps({"pid": other.pid,
                                                               "host": run_folder.socket.gethostname()}))
        with pytest.raises(OutputFolderError, match=f"in use by run PID {other.pid}"):
            TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward, args=_args(tmp_path), train_dataset=_dataset())
    finally:
        other.kill()
        other.wait()


@pytest.mark.slow
def test_trainer_refuses_a_new_run_into_a_finished_one(tmp_path, tiny_qwen3_dir):
    from triage_trl.trainer import TriageGRPOTrainer

    (tmp_path / "run" / "checkpoint-1").mkdir(parents=True)
    trainer = TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward, args=_args(tmp_path), train_dataset=_dataset())
    assert (tmp_path / "run" / LOCK_NAME).is_file()
    with pytest.raises(OutputFolderError, match="already holds a run"):
        trainer.train()
    assert trainer.state.global_step == 0
    del trainer
    import gc

    gc.collect()
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released with the trainer


# --- on the command line: status 2 and one line, before the model is resolved ---
def _last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_refuses_read_only_full_held_and_finished_folders(tmp_path, monkeypatch, capsys):
    from triage_trl.cli import main

    out = tmp_path / "run"
    argv = ["--config", "tiny_cpu", "--output_dir", str(out), "--report_to", "none"]
    with monkeypatch.context() as m:
        _read_only(m)
        assert main(argv) == 2
    assert _last_line(capsys).startswith(f"triage-grpo: error: output_dir {out} is on a read-only filesystem")
    assert not out.exists()
    with monkeypatch.context() as m:
        _full(m, free=1000)
        assert main(argv) == 2
    assert "less than one checkpoint of this model needs" in _last_line(capsys)
    shutil.rmtree(out, ignore_errors=True)
    (out / "checkpoint-3").mkdir(parents=True)
    assert main(argv) == 2
    assert "already holds a run (checkpoint-3): resume it with --resume_from_checkpoint true" in _last_line(capsys)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=child_process_env())
    try:
        (out / LOCK_NAME).write_text(json.dumps({"pid": other.pid, "host": run_folder.socket.gethostname()}))
        assert main([*argv, "--resume_from_checkpoint", "true"]) == 2
        assert f"is in use by run PID {other.pid}" in _last_line(capsys)
    finally:
        other.kill()
        other.wait()
