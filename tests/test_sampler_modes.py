"""Sleep mode, the reload context and server mode.

Sleep mode with a recording fake engine (vLLM has no sleep mode on CPU): the sync wakes the weights and reloads
through the worker RPC (inside vLLM's config context), the probe scores on a fully awake engine. Server mode: refused
by the config before any model loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triage_trl.sampler.direct_write import DirectWrite
from triage_trl.sampler.frozen_vocab import FrozenVocabSkip
from triage_trl.sampler.vllm_generation import TriageVLLMGeneration


class RecordingLLM:
    def __init__(self):
        self.calls = []

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(("collective_rpc", method, kwargs["is_checkpoint_format"]))
        list(kwargs["weights_iterator"])

    def apply_model(self, fn):
        self.calls.append(("apply_model", getattr(fn, "__name__", None) or fn.func.__name__))  # a partial too
        return [0]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        ids = prompts[0]["prompt_token_ids"]
        flat = SimpleNamespace(start_indices=list(range(len(ids))), end_indices=list(range(1, len(ids) + 1)),
                               token_ids=list(ids), logprobs=[-0.5] * len(ids))
        return [SimpleNamespace(prompt_logprobs=flat)]


def sleeping_sampler():
    llm = RecordingLLM()
    sampler = TriageVLLMGeneration.__new__(TriageVLLMGeneration)
    sampler.__dict__.update(
        llm=llm, model=torch.nn.Linear(2, 2), mode="colocate", enable_sleep_mode=True, _llm_weights_sleeping=True,
        sampler_precision="bf16",
        input_global_scales=None, recalibrate_every_sync=False, num_syncs=0, temperature=1.0, on_sync=None,
        frozen_vocab=FrozenVocabSkip(), _dist=SimpleNamespace(is_fsdp=False, is_zero3=False),
        direct_write=DirectWrite(), direct_write_ok=(False, "sleep mode discards and restores the weights"),
        _engine_loaded=True, _model_class=None,
    )
    sampler._iter_sampler_weights = lambda *args: iter([("w", None)])
    return sampler, llm


def test_sync_wakes_the_weights_and_reloads_through_the_worker_rpc():
    sampler, llm = sleeping_sampler()
    sampler.sync_weights()
    assert llm.calls == [("wake_up", ("weights",)), ("collective_rpc", "reload_weights", True),
                         ("apply_model", "after_cpu_reload"), ("reset_prefix_cache",)]
    assert sampler.num_syncs == 1 and not sampler._llm_weights_sleeping


def test_the_probe_inside_a_sync_runs_on_a_fully_awake_engine():
    sampler, llm = sleeping_sampler()
    scored = []
    sampler.on_sync = lambda: scored.append(sampler.score_logps([[3, 4, 5]]))
    sampler.sync_weights()
    assert scored == [[[-0.5, -0.5]]]
    names = [c[0] for c in llm.calls]
    # KV cache woken after the weights and before the probe's generate: nothing runs half asleep
    assert names == ["wake_up", "collective_rpc", "apply_model", "reset_prefix_cache", "wake_up", "generate"]
    assert llm.calls[4] == ("wake_up", ("kv_cache",))


def test_sleep_mode_refused_on_cpu_before_the_engine_starts():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("checks the CPU refusal")
    sampler = TriageVLLMGeneration.__new__(TriageVLLMGeneration)
    sampler.__dict__.update(mode="colocate", enable_sleep_mode=True, sampler_precision="bf16",
                            calibration_prompts=[])
    with pytest.raises(ValueError, match="no sleep mode on CPU"):
        sampler._init_vllm()


@pytest.mark.parametrize("overrides", [
    {"triage_mode": "full"},
    {"triage_mode": "off", "learner_precision": "nvfp4", "sampler_precision": "nvfp4"},
])
def test_server_mode_refused_at_config_time_naming_the_command_to_run(tmp_path, overrides):
    from triage_trl.trainer import TriageGRPOConfig

    with pytest.raises(NotImplementedError, match="`--vllm_mode colocate`.*triage_mode='off' and bf16 precisions"):
        TriageGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                         num_generations=4, report_to="none", use_vllm=True, vllm_mode="server", **overrides)
