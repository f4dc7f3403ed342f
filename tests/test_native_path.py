"""torchao's native NVFP4 learner path (sm100+): which recipes may take it, the padding it needs, and the inputs the
trainer pads for it. CPU only: the native kernels themselves are exercised by scripts/gpu_check.py."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn

from triage_trl.nvfp4 import native
from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.trainer.sync_probe import probe_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))
NATIVE_RECIPE = {"learner_precision": "nvfp4", "sampler_precision": "nvfp4", "nvfp4_learner_scales": "dynamic"}


# ------------------------------------------------------------------ which recipes the native kernels run


def test_native_kernels_run_only_torchaos_recipe():
    assert NVFP4Config(**NATIVE_RECIPE).native_learner_blockers() == []
    both = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4")  # default: the sampler's scales
    assert [b.split(" (")[0] for b in both.native_learner_blockers()] == ["nvfp4_learner_scales='sampler'"]
    four = NVFP4Config(**NATIVE_RECIPE, nvfp4_four_over_six=True)
    assert [b.split(" (")[0] for b in four.native_learner_blockers()] == ["nvfp4_four_over_six"]
    weight_only = NVFP4Config(**NATIVE_RECIPE, nvfp4_sampler_kernel="weight_only")
    assert [b.split(" (")[0] for b in weight_only.native_learner_blockers()] == ["nvfp4_sampler_kernel='weight_only'"]


def test_native_with_the_samplers_scales_is_refused_not_partial():
    explicit = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4", nvfp4_learner_kernel="native")
    with pytest.raises(ValueError, match="nvfp4_learner_scales='sampler'.*nvfp4_learner_kernel='emulated'"):
        explicit.validate_nvfp4()
    auto = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4")
    # auto with the sampler's scales: every layer emulated, and the reason says why, on any device
    assert native.choose_learner_path(auto, None) == (False, auto.native_learner_blockers()[0])
    with pytest.raises(ValueError, match="cannot run this recipe"):
        native.choose_learner_path(auto, True)


# ------------------------------------------------------------------ pad_to_multiple_of, checked at config time


def test_explicit_native_without_padding_is_refused_before_a_model_loads(grpo_config):
    with pytest.raises(ValueError, match="pad_to_multiple_of=None.*pad_to_multiple_of=128"):
        grpo_config(**NATIVE_RECIPE, nvfp4_learner_kernel="native")
    with pytest.raises(ValueError, match="pad_to_multiple_of=64"):
        grpo_config(**NATIVE_RECIPE, nvfp4_learner_kernel="native", pad_to_multiple_of=64)
    assert grpo_config(**NATIVE_RECIPE, nvfp4_learner_kernel="native", pad_to_multiple_of=256)
    assert grpo_config(**NATIVE_RECIPE, nvfp4_learner_kernel="emulated").pad_to_multiple_of is None


def test_auto_refuses_missing_padding_only_where_the_gpu_has_native_kernels(grpo_config, monkeypatch):
    assert grpo_config(**NATIVE_RECIPE).nvfp4_learner_kernel == "auto"  # CPU: emulated, no padding needed
    monkeypatch.setattr(native, "native_nvfp4_available", lambda device=None: (True, ""))
    with pytest.raises(ValueError, match="sm100\\+.*pad_to_multiple_of=None"):
        grpo_config(**NATIVE_RECIPE)
    assert grpo_config(**NATIVE_RECIPE, pad_to_multiple_of=128).pad_to_multiple_of == 128
    # the sampler's scales keep auto on the emulation: no padding asked for
    assert grpo_config(learner_precision="nvfp4", sampler_precision="nvfp4").pad_to_multiple_of is None


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_every_recipe_that_can_go_native_pads_to_128(recipe, tmp_path):
    from triage_trl.cli import make_parser

    cpu = [] if recipe.endswith("tiny_cpu.yaml") else ["--use_cpu", "true", "--bf16", "false"]
    _, args, _ = make_parser().parse_args_and_config(args=["--config", recipe, "--output_dir", str(tmp_path), *cpu])
    expected = "qwen3_30b_a3b" in recipe  # the recipes with dynamic learner scales
    assert native.native_path_possible(args) == (expected and args.learner_precision == "nvfp4")
    if native.native_path_possible(args):
        assert args.pad_to_multiple_of == native.NATIVE_MULTIPLE
        native.check_native_padding(args)  # the refusal would fire on an sm100 machine otherwise
    if "qwen3_30b_a3b" in recipe:  # the three 30B recipes pad alike
        assert args.pad_to_multiple_of == 128


# ------------------------------------------------------------------ padded inputs


def test_probe_batch_pads_right_to_the_multiple():
    ids, mask, keep = probe_batch([5, 6, 7], pad_token_id=0, multiple=4)
    assert ids.tolist() == [[5, 6, 7, 0]] and mask.tolist() == [[1, 1, 1, 0]] and keep == 3
    ids, mask, keep = probe_batch([5, 6, 7, 8], pad_token_id=0, multiple=4)
    assert ids.tolist() == [[5, 6, 7, 8]] and mask.tolist() == [[1, 1, 1, 1]] and keep == 3
    ids, mask, keep = probe_batch([5, 6, 7], pad_token_id=9, multiple=None)
    assert ids.tolist() == [[5, 6, 7]] and keep == 2


def _token_logps(model, input_ids, attention_mask):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def test_padding_the_probe_keeps_its_log_probs(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    probe = list(range(3, 53))  # 50 tokens, as the trainer's probe
    with torch.no_grad():
        plain = _token_logps(model, torch.tensor([probe]), torch.ones(1, len(probe), dtype=torch.long))[0]
        ids, mask, keep = probe_batch(probe, pad_token_id=0, multiple=128)
        padded = _token_logps(model, ids, mask)[0]
    assert ids.shape == (1, 128) and keep == 127 and padded.shape == (127,)
    torch.testing.assert_close(padded[: len(probe) - 1], plain, atol=1e-5, rtol=0)


class _NativeShapeCheck(nn.Linear):
    """Stands in for torchao's NVFP4Linear on CPU: refuses what ``nvfp4_mm_triton`` refuses."""

    def forward(self, x):
        if x.shape[-2] % native.NATIVE_MULTIPLE:
            raise ValueError("nvfp4_mm_triton requires M, K, N all divisible by 128")
        return super().forward(x)


def test_calibration_runs_native_layers_as_float_at_any_prompt_length(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triage_trl.nvfp4.calibration import calibrate_input_global_scales

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompts = ["1 + 2 =", "What is 17 times 3? Answer in one line."]  # odd lengths, no padding
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    expected = calibrate_input_global_scales(plain, tokenizer, prompts)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    swapped = _NativeShapeCheck(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    swapped.weight = mlp.down_proj.weight
    swapped.nvfp4_learner_path = "native"
    mlp.down_proj = swapped
    with pytest.raises(ValueError, match="divisible by 128"):
        model(input_ids=tokenizer(prompts[0], return_tensors="pt")["input_ids"])
    scales = calibrate_input_global_scales(model, tokenizer, prompts)
    assert scales.keys() == expected.keys() and len(scales) > 0
    assert all(torch.equal(scales[k], expected[k]) for k in expected)
