"""TRL's quickstart call, ``trainer.close()`` and ``with TriageGRPOTrainer(...)``: the in-process vLLM engine is freed
and a second trainer starts in the same process (slow: two engine starts and one training step on a tiny Qwen3).

Runs in a subprocess: vLLM's parallel groups are process globals, and closing an engine tears them down for every
engine of the process, including the session-cached trainers of other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from triage_trl.runtime import child_process_env

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KV_CACHE_GIB = 1

SCENARIO = f"""
import gc, json, weakref
import psutil, torch
from triage_trl.data.arith import arith_dataset
from triage_trl.rewards import digit_share_reward
from triage_trl.runtime import vllm_process_settings
from triage_trl.testing import save_tiny_qwen3
from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer

def rss(collect=True):
    if collect:
        gc.collect()
    return psutil.Process().memory_info().rss / 2**30

model, ds, out = str(save_tiny_qwen3("tiny")), arith_dataset(8, seed=0), {{}}
with vllm_process_settings(cpu_kv_cache_gib={KV_CACHE_GIB}):
    out["rss_before"] = rss()
    trainer = TriageGRPOTrainer(model, digit_share_reward, train_dataset=ds)  # TRL's quickstart call, args=None
    out["args"] = [trainer.args.output_dir, trainer.args.use_vllm, trainer.args.vllm_mode, trainer.args.triage_mode]
    llm = weakref.ref(trainer.vllm_generation.llm)
    core = weakref.ref(trainer.vllm_generation.llm.llm_engine.engine_core.engine_core)  # vLLM's EngineCore
    out["rss_started"] = rss()
    trainer.close()
    out["core_freed"] = core() is None  # by close() itself: no collection of ours in between
    import vllm.distributed.parallel_state, vllm.v1.worker.gpu_model_runner
    out["vllm_gc_restored"] = (vllm.distributed.parallel_state.gc is gc and vllm.v1.worker.gpu_model_runner.gc is gc)
    out["rss_closed"] = rss(collect=False)
    trainer.close()  # a second call does nothing
    out["llm_freed"] = llm() is None
    args = TriageGRPOConfig(output_dir="second", use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=8, vllm_max_model_length=128, logging_steps=1,
                            save_strategy="no", report_to="none", model_init_kwargs={{"dtype": torch.bfloat16}})
    with TriageGRPOTrainer(model, digit_share_reward, args=args, train_dataset=ds) as second:
        second.train()
        llm = weakref.ref(second.vllm_generation.llm)
    out["second"] = [second.state.global_step, second.vllm_generation.num_syncs, len(second.sync_probe_gaps)]
    out["second_freed"] = second.vllm_generation.llm is None and llm() is None
    # TRL's tests and notebooks drop trainers without close(): the next trainer's start shuts the dropped engine down
    # (vLLM's engine start freezes every object then alive, the trainer included, out of the collector's sight)
    dropped = TriageGRPOTrainer(model, digit_share_reward, args=args, train_dataset=ds)
    core = weakref.ref(dropped.vllm_generation.llm.llm_engine.engine_core.engine_core)
    del dropped
    from triage_trl.sampler import vllm_generation
    out["rss_dropped"] = rss(collect=False)
    fourth = TriageGRPOTrainer(model, digit_share_reward, args=args, train_dataset=ds)
    out["dropped"] = [core() is None, len(vllm_generation._LIVE)]
    out["rss_fourth"] = rss(collect=False)
    fourth.close()
print("RESULT " + json.dumps(out))
"""


def test_quickstart_close_and_a_second_trainer_in_one_process(tmp_path):
    env = child_process_env(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCENARIO], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["args"] == ["tiny-TRIAGE-GRPO", True, "colocate", "full"]  # TRIAGE on: the colocated vLLM sampler
    assert out["llm_freed"] and out["second_freed"] and out["core_freed"]
    assert out["vllm_gc_restored"]  # vLLM's shutdown collections are deferred only while close() shuts it down
    assert out["second"] == [1, 1, 1]  # one step, one sync, one sync probe
    # The engine's KV cache alone is KV_CACHE_GIB: starting takes at least half of it, closing gives it back.
    started, closed = out["rss_started"] - out["rss_before"], out["rss_started"] - out["rss_closed"]
    assert started > KV_CACHE_GIB / 2 and closed > KV_CACHE_GIB / 2, out
    assert out["dropped"] == [True, 1], out  # the dropped trainer's engine is gone; only the new one runs
    assert out["rss_fourth"] - out["rss_dropped"] < KV_CACHE_GIB / 2, out  # its KV cache given back for the new one


THREE_TRAINERS = """
import gc, json, os, warnings
import torch
from accelerate.state import PartialState
from triage_trl.data.arith import arith_dataset
from triage_trl.rewards import digit_share_reward
from triage_trl.runtime import vllm_process_settings
from triage_trl.sampler import vllm_generation as engine
from triage_trl.testing import save_tiny_qwen3, save_tiny_qwen3_moe
from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer

def state():
    from vllm.distributed import parallel_state as ps
    return {"dist": torch.distributed.is_initialized(), "vllm_world": ps._WORLD is not None,
            "vllm_tp": ps._TP is not None,
            "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
            "threads": torch.get_num_threads(), "accelerate": str(PartialState().distributed_type),
            "engines": len(engine._LIVE)}

def args(name):
    return TriageGRPOConfig(output_dir=name, use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=8, vllm_max_model_length=128, save_strategy="no",
                            report_to="none")

def fail_after_start(self):
    raise RuntimeError("construction failed after the engine started")

model, ds, out = str(save_tiny_qwen3("tiny")), arith_dataset(8, seed=0), {}
with vllm_process_settings(cpu_kv_cache_gib=0.125):  # tests/conftest.py's TEST_KV_CACHE_GIB
    out["found"] = state()
    first = TriageGRPOTrainer(model, digit_share_reward, args=args("first"), train_dataset=ds)
    first.train()  # never closed
    out["with_first"] = state()

    real = TriageGRPOTrainer._push_sampler_scales
    TriageGRPOTrainer._push_sampler_scales = fail_after_start  # the last thing __init__ does
    try:
        TriageGRPOTrainer(model, digit_share_reward, args=args("second"), train_dataset=ds)
    except RuntimeError as error:
        out["second_error"] = str(error)
    TriageGRPOTrainer._push_sampler_scales = real
    gc.collect()
    out["after_failure"] = state()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a MoE model next to the dense engine: vLLM made no expert-parallel group for the dense one
        moe = str(save_tiny_qwen3_moe("tiny-moe"))
        third = TriageGRPOTrainer(moe, digit_share_reward, args=args("third"), train_dataset=ds)
    out["warned_close"] = any("close()" in str(w.message) for w in caught)
    third.train()  # next to the first one's engine
    first.sync_sampler()  # the first still syncs and probes next to the third
    out["steps"] = [first.state.global_step, len(first.sync_probe_gaps), third.state.global_step,
                    len(third.sync_probe_gaps)]
    out["with_both"] = state()
    # Only now, after the three-trainer part: closing one leaves the other's groups; the last puts the process back.
    first.close()
    third.sync_sampler()
    out["third_probes"] = len(third.sync_probe_gaps)
    third.close()
    try:
        third.sync_sampler()
    except RuntimeError as error:
        out["closed_reuse"] = str(error)
    out["closed"] = state()
print("RESULT " + json.dumps(out))
"""


def test_three_trainers_in_one_process_none_closed_the_middle_one_failing(tmp_path):
    """TRL's tests build trainer after trainer in one process and never call close(): the middle construction fails
    after its engine started; the first trainer's engine still runs when the third (a MoE model) starts, and both
    keep working.
    Closing them afterwards puts the process back as it was found."""
    env = child_process_env(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", THREE_TRAINERS], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    found = out["found"]
    assert found["dist"] is False and found["vllm_world"] is False and found["engines"] == 0
    assert out["with_first"]["dist"] and out["with_first"]["engines"] == 1
    assert out["second_error"] == "construction failed after the engine started"
    assert out["after_failure"] == out["with_first"]  # the failed construction shut its own engine down, only it
    assert out["warned_close"]  # the third start names close() for the first engine, still held
    assert out["steps"] == [1, 2, 1, 1]  # both trained one step; the first synced and probed again afterwards
    assert out["with_both"]["engines"] == 2 and out["with_both"]["dist"]
    assert out["third_probes"] == 2  # the third's engine outlived the first's close
    assert "was closed" in out["closed_reuse"]
    assert out["closed"] == found, out  # the last engine's close put the process back as it was found
