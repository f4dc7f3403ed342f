"""The entry point, recipes and synthetic arithmetic task (fast: parsing and data only, no training)."""

from __future__ import annotations

import glob
import os

import pytest

from triage_trl.cli import make_parser, resolve_reward_funcs, run
from triage_trl.data.arith import arith_dataset
from triage_trl.rewards import boxed_answer_reward, digit_share_reward
from triage_trl.runs import TINY_MODEL, resolve_model
from triage_trl.trainer import TriageGRPOConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


def test_there_are_the_seven_recipes():
    names = {os.path.basename(p) for p in RECIPES}
    assert "tiny_cpu.yaml" in names
    for size in ("4b", "30b_a3b"):
        for variant in ("bf16", "nvfp4_naive", "nvfp4_triage"):
            assert f"qwen3_{size}_{variant}.yaml" in names


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipes_parse_with_trl_parser(recipe, tmp_path):
    # GPU recipes ask for bf16, which TrainingArguments refuses without a GPU: override for parsing only.
    cpu = [] if recipe.endswith("tiny_cpu.yaml") else ["--use_cpu", "true", "--bf16", "false"]
    script, args, model = make_parser().parse_args_and_config(
        args=["--config", recipe, "--output_dir", str(tmp_path), *cpu]
    )
    assert isinstance(args, TriageGRPOConfig)
    assert args.use_vllm and args.vllm_mode == "colocate"
    assert args.vllm_importance_sampling_correction is False  # TRIAGE on in every recipe
    resolve_reward_funcs(script.reward_funcs)
    if "nvfp4" in recipe or "tiny" in recipe:
        assert args.learner_precision == args.sampler_precision == "nvfp4"
    if "triage" in recipe or "tiny" in recipe:
        assert args.triage_mode == "full"
    else:
        assert args.triage_mode == "diagnose"


def test_cli_overrides_beat_the_recipe(tmp_path):
    recipe = os.path.join(ROOT, "recipes", "tiny_cpu.yaml")
    _, args, _ = make_parser().parse_args_and_config(
        args=["--config", recipe, "--output_dir", str(tmp_path), "--triage_mode", "diagnose",
              "--nvfp4_exclude_patterns", "mlp.gate$", "router", "--sync_probe_max_gap", "0.3", "--max_steps", "1"]
    )
    assert args.triage_mode == "diagnose" and args.max_steps == 1
    assert args.nvfp4_exclude_patterns == ["mlp.gate$", "router"] and args.sync_probe_max_gap == 0.3


def test_tiny_model_is_built_offline_once(tmp_path):
    path = resolve_model(TINY_MODEL, str(tmp_path))
    assert os.path.isfile(os.path.join(path, "config.json"))
    mtime = os.path.getmtime(os.path.join(path, "config.json"))
    assert resolve_model(TINY_MODEL, str(tmp_path)) == path
    assert os.path.getmtime(os.path.join(path, "config.json")) == mtime
    assert resolve_model("Qwen/Qwen3-4B", str(tmp_path)) == "Qwen/Qwen3-4B"
    with pytest.raises(FileNotFoundError, match="does not exist: give a local folder"):
        resolve_model("./no/such/model", str(tmp_path))


def test_cli_needs_a_model(tmp_path):
    recipe = os.path.join(ROOT, "recipes", "tiny_cpu.yaml")
    script, args, model = make_parser().parse_args_and_config(args=["--config", recipe, "--output_dir", str(tmp_path)])
    model.model_name_or_path = None
    with pytest.raises(ValueError, match="model_name_or_path"):
        run(script, args, model)


def test_unknown_reward_function_names_the_choices():
    with pytest.raises(ValueError, match="boxed_answer_reward"):
        resolve_reward_funcs(["nope"])


def test_arith_dataset_and_rewards():
    ds = arith_dataset(16, seed=1, max_operand=9)
    assert len(ds) == 16 and set(ds.column_names) == {"prompt", "answer"}
    q = ds[0]["prompt"][0]["content"]
    a, op, b = q.removeprefix("What is ").split("?")[0].split()
    assert ds[0]["answer"] == str(eval(f"{a}{op}{b}"))  # noqa: S307 - digits and one operator from our builder
    assert arith_dataset(16, seed=1, max_operand=9)["answer"] == ds["answer"]
    completions = [[{"role": "assistant", "content": "so \\boxed{7}"}], [{"role": "assistant", "content": "\\boxed{8}"}]]
    assert boxed_answer_reward(completions, answer=["7", "7"]) == [1.0, 0.0]
    assert digit_share_reward(["a1", "", "12"]) == [0.5, 0.0, 1.0]
    with pytest.raises(ValueError, match="ops"):
        arith_dataset(4, ops="/")
