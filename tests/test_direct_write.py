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


def test_joined_takes_consecutive_row_blocks_of_one_tensor_without_a_copy():
    """A fused group quantised in one buffer arrives as its members' row blocks: joined, they are that buffer (no
    copy); anything else is concatenated, with the same values."""
    import torch

    from triage_trl.sampler.direct_write import _joined

    buffer = torch.arange(24.0).reshape(6, 4)
    joined = _joined([buffer[0:2], buffer[2:6]])
    assert torch.equal(joined, buffer) and joined.data_ptr() == buffer.data_ptr()
    part = _joined([buffer[1:3], buffer[3:4]])
    assert torch.equal(part, buffer[1:4]) and part.data_ptr() == buffer[1:4].data_ptr()
    offset = torch.arange(40.0)[4:].view(6, 6)  # a base that does not start its storage, one-row blocks
    assert torch.equal(_joined([offset[2:3], offset[3:5]]), offset[2:5])
    assert _joined([offset[2:3], offset[3:5]]).data_ptr() == offset[2:5].data_ptr()
    for tensors in ([buffer[2:4], buffer[0:2]], [buffer[0:2], buffer[3:5]], [buffer[0:2], buffer[2:4].clone()],
                    [buffer[0:2, :2], buffer[2:4, :2]], [buffer.reshape(-1)[0:4], buffer.reshape(-1)[8:12]]):
        out = _joined(tensors)
        assert torch.equal(out, torch.cat(tensors)) and out.data_ptr() != buffer.data_ptr()
