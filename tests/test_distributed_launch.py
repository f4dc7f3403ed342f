"""Two CPU processes (gloo) through ``accelerate launch``, the tiny recipe, 3 optimizer steps, NVFP4 sampler +
NVFP4 learner + TRIAGE full, DDP (slow; runs in CI).

``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml`` really starts two processes (the config's
``MULTI_GPU`` type makes accelerate launch through torchrun; the recipe's ``use_cpu: true`` makes each process take
accelerate's ``MULTI_CPU`` gloo path). ``tests/distributed_entry.py`` trains through the CLI and writes what each
rank saw; this test compares the two ranks. Measured facts about the two colocated vLLM CPU engines are in
``docs/scale.md`` ("Two processes on one CPU machine").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from triage_trl.runtime import child_process_env


pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory):
    """Run the tiny recipe on two processes once; the two ranks' reports."""
    out = tmp_path_factory.mktemp("ddp")
    # the child's own free MASTER_PORT (accelerate's default, 29500, may be held by another run's ranks)
    env = child_process_env(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--main_process_port", env["MASTER_PORT"],
           str(REPO / "tests" / "distributed_entry.py"),
           "--config", str(REPO / "recipes" / "tiny_cpu.yaml"), "--output_dir", str(out),
           "--report_to", "none"]  # the report's extra sync logs after train() has ended the tracker's run
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


def test_two_ranks_really_train_together(ddp_ranks):
    for rank, facts in enumerate(ddp_ranks):
        assert facts["rank"] == rank and facts["num_processes"] == 2
        assert facts["distributed_type"] == "DistributedType.MULTI_CPU"
        assert facts["global_step"] == 3
        # 32 prompts, 4 completions per process per step, 4 per prompt: 2 prompts a step with two processes.
        assert facts["epochs"] == [0.0625, 0.125, 0.1875]
        # each rank's micro-batch is one prompt's 4 completions: its learner forwards scored the prompt once
        assert facts["learner_forwards"]["shared_prompt"] >= 3, facts["learner_forwards"]


def test_loss_is_finite_and_triage_metrics_are_logged(ddp_ranks):
    from triage_trl import METRIC_NAMES

    for facts in ddp_ranks:
        assert len(facts["losses"]) == 3 and all(math.isfinite(x) for x in facts["losses"])
        assert {f"triage/{name}" for name in METRIC_NAMES} <= set(facts["triage_metrics"])
        assert "triage/sync_probe_gap" in facts["triage_metrics"]


def test_activation_scales_and_learner_weights_are_identical_on_both_ranks(ddp_ranks):
    first, second = ddp_ranks
    assert len(first["input_global_scales"]) == 14  # every decoder linear of the tiny Qwen3
    assert first["input_global_scales"] == second["input_global_scales"]
    assert first["learner_digest"] == second["learner_digest"]


def test_each_rank_samples_the_current_weights(ddp_ranks):
    for facts in ddp_ranks:
        assert facts["num_syncs"] == 4  # one per step, one after training
        bound = facts["probe_bound"]
        assert len(facts["probe_rank_gaps"]) == 4
        assert all(len(gaps) == 2 and max(gaps) <= bound for gaps in facts["probe_rank_gaps"])
        assert 0 <= facts["final_local_probe_gap"] <= bound


def test_each_rank_runs_its_own_engine_on_one_thread(ddp_ranks):
    for rank, facts in enumerate(ddp_ranks):
        engine = facts["engine"]
        assert engine["seed"] == rank  # recipe seed 0 + rank: the ranks sample differently
        assert engine["load_format"] == "dummy" and engine["distributed_executor_backend"] == "external_launcher"
        assert engine["vllm_world_size"] == 2 and engine["vllm_tp_size"] == 1 and engine["vllm_world_rank"] == rank
        assert "FastCpuNvFp4LinearKernel x8" in engine["kernel_report"]["linear_kernels"]
        # torchrun's OMP_NUM_THREADS=1; the in-process CPU worker binds no cores and torch's threads come back.
        assert facts["before_start"] == facts["after_train"]
    first, second = ddp_ranks
    assert first["checkpoint_dir"] == second["checkpoint_dir"]  # one node: one folder, written once
    assert "config.json" in first["checkpoint_files"]
