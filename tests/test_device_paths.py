"""The learner's NVFP4 layers and the objective on ``TRIAGE_TEST_DEVICE`` (CPU by default; CUDA under
``scripts/gpu_check.py``): odd sequence lengths, weight-cache invalidation, and the objective against CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triage_trl.nvfp4.emulated import NVFP4EmulatedLinear
from triage_trl.nvfp4.numerics import quant_dequant_torchao_dynamic


def _layer(device, in_features=256, out_features=128):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False).to(device)
    return NVFP4EmulatedLinear.from_linear(linear, name="l", compiled=False, compute_dtype=torch.float32)


@pytest.mark.parametrize("tokens", [1, 7, 50, 129])
def test_emulated_layer_at_odd_sequence_lengths(test_device, tokens):
    if test_device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    layer = _layer(test_device)
    x = torch.randn(2, tokens, 256, device=test_device, requires_grad=True)
    y = layer(x)
    expected = F.linear(quant_dequant_torchao_dynamic(x.detach()), quant_dequant_torchao_dynamic(layer.weight.detach()))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(layer.weight.grad).all()


def test_weight_cache_follows_in_place_updates(test_device):
    from triage_trl.nvfp4.learner import invalidate_nvfp4_weight_caches

    layer = _layer(test_device)
    model = torch.nn.Sequential(layer)
    x = torch.randn(3, 256, device=test_device)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an optimizer step in place: the cache still holds the old weight
    assert torch.equal(layer(x), before)
    assert invalidate_nvfp4_weight_caches(model) == 1
    torch.testing.assert_close(layer(x), 2.0 * before, rtol=1e-6, atol=1e-6)  # power-of-two scaling is exact


def test_objective_on_the_device_matches_cpu(test_device):
    from triage_trl import TriageConfig, triage_weights

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 64, generator=g) * 3
    sampler = old + torch.randn(4, 64, generator=g) * 0.2
    adv = torch.randn(4, generator=g)
    mask = torch.arange(64)[None, :] < torch.tensor([[64], [40], [33], [17]])
    seg = (torch.arange(64) // 16).expand(4, 64).contiguous()
    cpu = triage_weights(old, sampler, adv, mask, seg, TriageConfig())
    dev = triage_weights(*(t.to(test_device) for t in (old, sampler, adv, mask, seg)), TriageConfig())
    assert dev.weights.device.type == test_device.type
    torch.testing.assert_close(dev.weights.cpu(), cpu.weights, rtol=1e-5, atol=1e-6)
    assert cpu.metrics.keys() == dev.metrics.keys()
