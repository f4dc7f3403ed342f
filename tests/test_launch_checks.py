"""Launches the trainer cannot run correctly are refused by ``TriageGRPOConfig``, before any model loads
(``triage_trl.trainer.distributed``); the node-local sampler folder and per-rank values.

The launch is set up the way ``accelerate launch`` and ``torchrun`` do it: through their environment variables.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from triage_trl.runtime import RENDEZVOUS_ENV
from triage_trl.trainer.distributed import Launch, launch_of, per_rank, sampler_checkpoint_dir

FSDP1 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}
FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
ZERO2 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
ZERO3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
NVFP4_BOTH = {"learner_precision": "nvfp4", "sampler_precision": "nvfp4"}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's environment variables for one test (restored after)."""

    def set_env(variables):
        # A launcher sets the rendezvous; earlier in-process engines of this session may have left theirs behind.
        for name in RENDEZVOUS_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_env


@pytest.mark.parametrize(
    "env, overrides, error, match",
    [
        (FSDP2, {}, NotImplementedError, "silently runs plain data parallel.*cpu_ddp.yaml"),
        (ZERO3, {}, NotImplementedError, "accelerate runs FSDP and DeepSpeed only on accelerators"),
        (FSDP1, {"use_cpu": False}, NotImplementedError, "fsdp_version: 2"),
        (FSDP2, {"use_cpu": False, **NVFP4_BOTH}, NotImplementedError, "undoes the sharding.*nvfp4_weight_cache: false"),
        (ZERO3, {"use_cpu": False, **NVFP4_BOTH, "nvfp4_weight_cache": False}, NotImplementedError,
         "ZeRO-3 gathers only the running layer's weights.*nvfp4_learner_scales='dynamic'"),
        (ZERO3, {"use_cpu": False, "learner_precision": "nvfp4", "nvfp4_learner_scales": "dynamic"},
         NotImplementedError, "nvfp4_weight_cache=True.*undoes the sharding"),
        ({"WORLD_SIZE": "2"}, {"use_cpu": False}, RuntimeError, "every process would train its own copy.*use_cpu"),
    ],
    ids=["fsdp-on-cpu", "deepspeed-on-cpu", "fsdp1", "fsdp2-nvfp4-learner-cache", "zero3-sampler-scales",
         "zero3-nvfp4-learner-cache", "processes-that-train-alone"],
)
def test_unsupported_launches_are_refused_before_a_model_loads(grpo_config, launched, env, overrides, error,
                                                               match):
    launched(env)
    with pytest.raises(error, match=match):
        grpo_config(**overrides)


NO_CACHE = {"nvfp4_weight_cache": False}


@pytest.mark.parametrize(
    "env, overrides, kind",
    [
        (FSDP2, {"use_cpu": False, "sampler_precision": "nvfp4"}, "fsdp"),
        (FSDP2, {"use_cpu": False, **NVFP4_BOTH, **NO_CACHE}, "fsdp"),
        (FSDP2, {"use_cpu": False, "learner_precision": "nvfp4", **NO_CACHE}, "fsdp"),
        ({"WORLD_SIZE": "1"}, {"use_cpu": False, **NVFP4_BOTH}, "single"),
        (ZERO3, {"use_cpu": False, "sampler_precision": "nvfp4"}, "deepspeed"),
        (ZERO3, {"use_cpu": False, "learner_precision": "nvfp4", "nvfp4_learner_scales": "dynamic", **NO_CACHE},
         "deepspeed"),
        (ZERO2, {"use_cpu": False}, "deepspeed"),
        (ZERO2, {"use_cpu": False, **NVFP4_BOTH}, "deepspeed"),
        ({}, NVFP4_BOTH, "single"),
    ],
    ids=["fsdp2-bf16-learner", "fsdp2-nvfp4-sampler-scales", "fsdp2-nvfp4-dynamic", "ddp-launcher-one-process",
         "zero3-bf16-learner", "zero3-nvfp4-dynamic", "zero2-bf16", "zero2-nvfp4", "single-nvfp4"],
)
def test_supported_launches_build_their_config(grpo_config, launched, env, overrides, kind):
    launched(env)
    if kind == "deepspeed" and not HAS_DEEPSPEED:  # the CPU test machines: the remedy is named before TRL's checks
        with pytest.raises(ImportError, match="ZeRO-.* needs DeepSpeed, which is not installed: pip install deepspeed"):
            grpo_config(**overrides)
        return
    args = grpo_config(**overrides)
    assert launch_of(args).kind == kind


def test_launch_is_read_from_accelerate_variables_and_training_arguments(tmp_path, launched):
    launched({**ZERO3, "WORLD_SIZE": "1"})
    unset = SimpleNamespace(use_cpu=False, fsdp=None, deepspeed=None)
    assert launch_of(unset) == Launch("deepspeed", 1, zero_stage=3)
    stage2 = tmp_path / "ds.json"
    stage2.write_text('{"zero_optimization": {"stage": 2}}')
    assert launch_of(SimpleNamespace(use_cpu=False, fsdp=None, deepspeed=str(stage2))).zero_stage == 2
    assert Launch("deepspeed", 8, zero_stage=3).shards_parameters
    assert not Launch("deepspeed", 8, zero_stage=2).shards_parameters
    assert Launch("fsdp", 8, fsdp_version=2).describe() == "fsdp (fsdp_version 2) on 8 process(es)"


def test_one_process_reads_its_own_values_and_its_checkpoint_folder(tmp_path):
    one = SimpleNamespace(num_processes=1, device="cpu")
    assert per_rank(one, 0.25) == [0.25]
    args = SimpleNamespace(sampler_checkpoint_dir=None, output_dir=str(tmp_path))
    assert sampler_checkpoint_dir(args, one) == str(tmp_path / "_sampler_checkpoint")
    args.sampler_checkpoint_dir = "/local/ssd/sampler"
    assert sampler_checkpoint_dir(args, one) == "/local/ssd/sampler"


@pytest.mark.parametrize("hosts, expected", [(["a", "a"], "ckpt"), (["b", "a"], "ckpt/node1")])
def test_several_nodes_get_one_sampler_folder_each(monkeypatch, hosts, expected):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "gather_object", lambda objs: hosts)
    monkeypatch.setattr("socket.gethostname", lambda: "b")
    two = SimpleNamespace(num_processes=2)
    args = SimpleNamespace(sampler_checkpoint_dir="ckpt", output_dir="out")
    assert sampler_checkpoint_dir(args, two) == expected
