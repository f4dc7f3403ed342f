"""``cpu_reload.refresh_cpu_mamba_conv_weights``: a CPU twin of the Mamba-2 convolution a reload leaves stale.

The real case needs an AVX512-BF16 CPU, where vLLM packs the convolution weight for its C++ kernels
(``tests/test_trl_grpo_suite.py::test_train[NemotronH]`` failed there with a stale-sampler error, gap 0.213 nats);
these tests build the same module layout with plain tensors, so they run on every CPU kind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from triage_trl.sampler.cpu_reload import refresh_cpu_mamba_conv_weights


class _Conv(nn.Module):
    def __init__(self, dim: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, 1, width, dtype=torch.bfloat16), requires_grad=False)


class _Mixer(nn.Module):
    """``MambaMixer2``'s layout: ``conv_weights`` registered as a ``[dim, width]`` view of ``conv1d.weight``."""

    def __init__(self, dim: int = 8, width: int = 4):
        super().__init__()
        self.conv1d = _Conv(dim, width)
        self.register_buffer("conv_weights", self.conv1d.weight.view(dim, width), persistent=False)


def _packed_reload(mixer: _Mixer, new: torch.Tensor) -> None:
    """What an AVX512-BF16 reload does: new storage for the packed weight, the unpacked values stashed."""
    mixer.conv1d.weight.data = new.flip(-1).contiguous().unsqueeze(1)  # another layout, another storage
    mixer.conv1d._cpu_unpacked_conv_weight = new.clone()


def test_a_packed_reload_leaves_the_view_stale_and_the_refresh_points_it_at_the_loaded_weights():
    model = nn.Sequential(_Mixer(), _Mixer())
    loaded = [torch.randn(8, 4).to(torch.bfloat16) for _ in model]
    for mixer, new in zip(model, loaded):
        _packed_reload(mixer, new)
        assert not torch.equal(mixer.conv_weights, new)  # the defect: the forward's view kept the old weights
    assert refresh_cpu_mamba_conv_weights(model) == 2
    for mixer, new in zip(model, loaded):
        assert torch.equal(mixer.conv_weights, new)
    assert refresh_cpu_mamba_conv_weights(model) == 0  # nothing stale any more


def test_an_unpacked_reload_writes_through_the_view_and_nothing_is_copied():
    mixer = _Mixer()
    new = torch.randn(8, 1, 4).to(torch.bfloat16)
    mixer.conv1d.weight.data.copy_(new)  # AVX2: the reload copies back into the storage the view shares
    assert refresh_cpu_mamba_conv_weights(mixer) == 0
    assert torch.equal(mixer.conv_weights, new.view(8, 4))


def test_through_vllms_own_cpu_processing_the_refresh_follows_a_reload(monkeypatch):
    """vLLM 0.31's ``dispatch_cpu_unquantized_gemm`` as an AVX512-BF16 CPU runs it (the ISA check and the C++ pack
    patched, so it runs on every CPU kind): the first processing stashes and packs, a reload's processing of new
    weights does again, the mixer's view keeps the first weights until the refresh."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils as vllm_utils

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(ops, "causal_conv1d_weight_pack", lambda w: w.t().contiguous(), raising=False)
    mixer = _Mixer()
    first = torch.randn(8, 1, 4).to(torch.bfloat16)
    mixer.conv1d.weight.data.copy_(first)  # the first load writes the storage the view shares
    vllm_utils.dispatch_cpu_unquantized_gemm(mixer.conv1d, remove_weight=False)
    assert refresh_cpu_mamba_conv_weights(mixer) == 0  # after a first load nothing is stale
    new = torch.randn(8, 1, 4).to(torch.bfloat16)
    mixer.conv1d.weight = nn.Parameter(new.clone(), requires_grad=False)  # the reload's materialised layer
    vllm_utils.dispatch_cpu_unquantized_gemm(mixer.conv1d, remove_weight=False)
    assert torch.equal(mixer.conv_weights, first.view(8, 4))  # the defect, through vLLM's own code
    assert refresh_cpu_mamba_conv_weights(mixer) == 1
    assert torch.equal(mixer.conv_weights, new.view(8, 4))


def test_a_stash_of_another_size_is_refused_naming_the_remedy():
    mixer = _Mixer()
    _packed_reload(mixer, torch.randn(8, 4).to(torch.bfloat16))
    mixer.conv1d._cpu_unpacked_conv_weight = torch.zeros(8, 3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="lays the mixer out differently"):
        refresh_cpu_mamba_conv_weights(mixer)
