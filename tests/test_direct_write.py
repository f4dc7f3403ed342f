"""Where a sync may write into the engine's layers directly (``triage_trl.sampler.direct_write``); the engine tests
that compare it with vLLM's reload are in ``tests/test_sampler_engine.py``."""

import pytest


@pytest.mark.parametrize("change,reason", [
    ({}, ""),
    ({"on_cpu": False}, "not on vLLM's CPU platform"),
    ({"enforce_eager": False}, "enforce_eager=False"),
    ({"tensor_parallel_size": 2}, "tensor parallelism"),
    ({"sharded_learner": True}, "FSDP2 and ZeRO-3"),
    ({"sleep_mode": True}, "sleep mode"),
    ({"model_class": "TransformersForCausalLM"}, "model class 'TransformersForCausalLM'"),
])
def test_direct_write_runs_only_where_it_was_checked_against_the_reload(change, reason):
    from triage_trl.sampler.direct_write import direct_write_supported

    settings = dict(model_class="LlamaForCausalLM", on_cpu=True, enforce_eager=True, tensor_parallel_size=1,
                    sharded_learner=False, sleep_mode=False)
    ok, why = direct_write_supported(**{**settings, **change})
    assert ok == (not change) and (reason in why if change else why == "")
