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

def rss():
    gc.collect()
    return psutil.Process().memory_info().rss / 2**30

model, ds, out = str(save_tiny_qwen3("tiny")), arith_dataset(8, seed=0), {{}}
with vllm_process_settings(cpu_kv_cache_gib={KV_CACHE_GIB}):
    out["rss_before"] = rss()
    trainer = TriageGRPOTrainer(model, digit_share_reward, train_dataset=ds)  # TRL's quickstart call, args=None
    out["args"] = [trainer.args.output_dir, trainer.args.use_vllm, trainer.args.vllm_mode, trainer.args.triage_mode]
    llm = weakref.ref(trainer.vllm_generation.llm)
    out["rss_started"] = rss()
    trainer.close()
    trainer.close()  # a second call does nothing
    out["llm_freed"] = llm() is None
    out["rss_closed"] = rss()
    args = TriageGRPOConfig(output_dir="second", use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=8, vllm_max_model_length=128, logging_steps=1,
                            save_strategy="no", report_to="none", model_init_kwargs={{"dtype": torch.bfloat16}})
    with TriageGRPOTrainer(model, digit_share_reward, args=args, train_dataset=ds) as second:
        second.train()
        llm = weakref.ref(second.vllm_generation.llm)
    out["second"] = [second.state.global_step, second.vllm_generation.num_syncs, len(second.sync_probe_gaps)]
    out["second_freed"] = second.vllm_generation.llm is None and llm() is None
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
    assert out["llm_freed"] and out["second_freed"]
    assert out["second"] == [1, 1, 1]  # one step, one sync, one sync probe
    # The engine's KV cache alone is KV_CACHE_GIB: starting takes at least half of it, closing gives it back.
    started, closed = out["rss_started"] - out["rss_before"], out["rss_started"] - out["rss_closed"]
    assert started > KV_CACHE_GIB / 2 and closed > KV_CACHE_GIB / 2, out
