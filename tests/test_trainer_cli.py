"""The entry point, recipes and synthetic arithmetic task (fast: parsing, checks and data only, no training)."""

from __future__ import annotations

import glob
import logging
import os
import sys

import pytest

from triage_trl import __version__
from triage_trl.cli import (
    configure_logging, main, make_parser, parse_args, prepare, resolve_recipe, resolve_reward_funcs, run,
)
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


# --- help, version, logging, recipes ---
def test_help_has_a_description_and_two_examples():
    text = make_parser().format_help()
    assert text.startswith("usage: triage-grpo")
    assert "GRPO and the TRIAGE objective" in text
    examples = text[text.index("examples:"):]
    assert examples.count("\n  triage-grpo ") == 2 and "triage-trl env" in examples
    assert "--config tiny_cpu" in examples and "--dataset_column_map" in examples
    assert "shared/" not in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        make_parser().parse_args_and_config(args=["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"triage-trl {__version__}"


def test_logging_shows_the_triage_info_reports(capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers = []
    try:
        configure_logging()
        logging.getLogger("triage_trl.trainer.grpo_trainer").info("NVFP4 learner layers: x")
        logging.getLogger("transformers.foo").info("not shown")
    finally:
        root.handlers, _ = saved
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert "INFO triage_trl.trainer.grpo_trainer: NVFP4 learner layers: x" in err and "not shown" not in err


def test_config_takes_a_shipped_recipe_name(tmp_path):
    shipped = resolve_recipe("tiny_cpu")
    assert shipped.endswith(os.path.join("triage_trl", "recipes", "tiny_cpu.yaml")) and os.path.isfile(shipped)
    own = os.path.join(ROOT, "recipes", "qwen3_4b_bf16.yaml")
    assert resolve_recipe(own) == own  # a file wins
    script, args, _ = parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path)])
    assert script.dataset_name == "arith" and args.learner_precision == "nvfp4"
    with pytest.raises(FileNotFoundError, match="tiny_cpu"):
        resolve_recipe("no_such_recipe")


# --- one-line errors (exit status 2, nothing loaded) ---
def _last_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and not any(line.startswith("Traceback") for line in err)
    return err[-1]


def test_bad_config_values_end_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path), "--vllm_importance_sampling_correction",
                    "true"])
    assert exit_.value.code == 2
    assert _last_line(capsys).startswith("triage-grpo: error: vllm_importance_sampling_correction=True")
    with pytest.raises(SystemExit):
        parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path), "--dataset_column_map", "{question"])
    assert "dataset_column_map is not JSON" in _last_line(capsys)
    with pytest.raises(SystemExit):
        parse_args(["--config", "nope.yaml"])
    assert "Recipe nope.yaml does not exist" in _last_line(capsys)


def test_a_misspelt_flag_or_a_value_outside_the_choices_ends_in_one_line_naming_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path), "--sync_probe_evry", "4"])
    assert exit_.value.code == 2
    assert _last_line(capsys).endswith("did you mean --sync_probe_evry -> --sync_probe_every?")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path), "--nvfp4_recipe", "nvfp4_paper"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "invalid choice: 'nvfp4_paper'" in err[0]
    assert err[0].startswith("triage-grpo: error:") and err[0].endswith("(`triage-grpo --help` lists every field)")


def test_missing_model_path_ends_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--config", "tiny_cpu", "--output_dir", str(out), "--model_name_or_path", "./no/such/model"]) == 2
    assert _last_line(capsys).startswith("triage-grpo: error: Model folder ./no/such/model does not exist")
    assert not out.exists()


def test_offline_hub_model_ends_in_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    argv = ["--config", "tiny_cpu", "--output_dir", str(tmp_path), "--model_name_or_path", "nobody/no-such-model-x1"]
    assert main(argv) == 2
    line = _last_line(capsys)
    assert "'nobody/no-such-model-x1' is not a local folder, the Hub cannot be reached" in line
    assert "hf download nobody/no-such-model-x1" in line


# --- QLoRA flags ---
@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        (["--load_in_4bit", "true"], ValueError, "--load_in_4bit .*cannot feed the vLLM sampler"),
        (["--load_in_8bit", "true"], ValueError, "--load_in_8bit .*cannot feed the vLLM sampler"),
        (["--load_in_4bit", "true", "--triage_mode", "off", "--use_vllm", "false", "--sampler_precision", "bf16"],
         ValueError, "learner_precision nvfp4"),
        (["--load_in_4bit", "true", "--triage_mode", "off", "--use_vllm", "false", "--sampler_precision", "bf16",
          "--learner_precision", "bf16"], ImportError, "needs bitsandbytes"),
    ],
)
def test_qlora_flags_are_refused_before_the_model_loads(tmp_path, extra, error, match):
    script, args, model = parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path / "run"), *extra])
    with pytest.raises(error, match=match):
        prepare(script, args, model)
    assert not (tmp_path / "run").exists()


def test_qlora_flags_pass_through_trl_without_the_sampler(tmp_path, monkeypatch):
    import transformers.utils
    import trl

    monkeypatch.setattr(transformers.utils, "is_bitsandbytes_available", lambda: True)
    monkeypatch.setattr(trl, "get_quantization_config", lambda model_args: ("bnb", model_args.bnb_4bit_quant_type))
    script, args, model = parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path), "--load_in_4bit", "true",
                                      "--triage_mode", "off", "--use_vllm", "false", "--sampler_precision", "bf16",
                                      "--learner_precision", "bf16"])
    assert prepare(script, args, model).quantization_config == ("bnb", "nf4")


# --- reward modules in the working directory ---
def test_reward_module_in_the_working_directory(tmp_path, monkeypatch):
    module = "def brevity(completions, **kw):\n    return [-len(c) for c in completions]\n"
    (tmp_path / "cwd_rewards_17.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    # As under the console script: sys.path holds the script's folder, not the working directory.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    (func,) = resolve_reward_funcs(["cwd_rewards_17.brevity"])
    assert func(["ab", "abcd"]) == [-2, -4]
    with pytest.raises(ValueError, match="no module 'no_such_rewards'"):
        resolve_reward_funcs(["no_such_rewards.f"])
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_reward_funcs(["cwd_rewards_17.nope"])


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


LAUNCH_ENV = {"fsdp2.yaml": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "single_gpu.yaml": {},
              "multi_gpu.yaml": {}, "cpu.yaml": {}}


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_every_recipe_passes_the_launch_checks_of_the_configs_its_header_names(recipe, tmp_path, monkeypatch):
    """The `accelerate launch` lines in each recipe's header: the config they name accepts the recipe (as
    `accelerate launch` sets its variables; bf16 off only because this machine has no GPU)."""
    import re

    with open(recipe) as f:
        configs = re.findall(r"^#\s+accelerate launch --config_file accelerate_configs/(\S+)", f.read(), re.M)
    assert configs, "the recipe's header names no accelerate config"
    for config in configs:
        with monkeypatch.context() as env:
            for name, value in LAUNCH_ENV[config].items():
                env.setenv(name, value)
            gpu = [] if config == "cpu.yaml" else ["--bf16", "false", "--use_cpu", "false"]
            _, args, _ = make_parser().parse_args_and_config(
                args=["--config", recipe, "--output_dir", str(tmp_path), *gpu])
        assert isinstance(args, TriageGRPOConfig), config
