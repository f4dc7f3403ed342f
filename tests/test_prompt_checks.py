"""Prompts checked before any model loads (``triage_trl.runtime.preflight.check_prompts``): empty, not text, or too
long for
the context, each refused in one line naming the data set, the row and the fix (status 2 on the command line)."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

from triage_trl.runtime.preflight import PromptError, check_prompts, context_tokens, dataset_prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


@pytest.mark.parametrize(
    ("prompts", "row", "problem"),
    [
        (["ok", ""], 1, "the prompt is empty"),
        (["  \n"], 0, "the prompt is empty"),
        (["ok", "ok", 7], 2, "the prompt is not text but int (7)"),
        ([None], 0, "the prompt is not text but NoneType"),
        ([[]], 0, "the prompt is empty (no message)"),
        ([[{"role": "user", "content": ""}]], 0, "the prompt is empty (every message's content is empty)"),
        ([[{"role": "user", "content": 3}]], 0, "the prompt has a message whose content is not text (int)"),
    ],
)
def test_bad_prompts_name_the_row_and_the_fix(prompts, row, problem):
    with pytest.raises(PromptError) as info:
        check_prompts(prompts, what="train_dataset")
    message = str(info.value)
    assert message.startswith(f"train_dataset row {row}: {problem}")
    assert "give every row a non-empty text prompt" in message and "\n" not in message


def test_prompt_longer_than_the_context(tokenizer):
    short, long = "What is 1 + 1?", "1 + 1 = 2. " * 40
    n = len(tokenizer(long, add_special_tokens=False)["input_ids"])
    check_prompts([short, long], tokenizer=tokenizer, context_tokens=n + 1)  # one token of room: fits
    with pytest.raises(PromptError, match=rf"train_dataset row 1: the prompt has {n} tokens, which leaves no room for "
                                          rf"a completion in the context of {n} tokens: raise --vllm_max_model_length"):
        check_prompts([short, long], tokenizer=tokenizer, context_tokens=n)
    chat = [[{"role": "user", "content": long}]]  # counted through the chat template, as TRL renders it
    with pytest.raises(PromptError, match="row 0: the prompt has"):
        check_prompts(chat, what="calibration_dataset", tokenizer=tokenizer, context_tokens=n + 1)


def test_context_and_prompt_column():
    class Args:
        use_vllm, vllm_max_model_length = True, 64

    class Config:
        max_position_embeddings = 1024

    assert context_tokens(Args(), Config()) == 64
    Args.use_vllm = False
    assert context_tokens(Args(), Config()) == 1024 and context_tokens(Args(), None) is None
    assert dataset_prompts(Dataset.from_dict({"prompt": ["a"], "x": [1]})) == ["a"]
    assert dataset_prompts(Dataset.from_dict({"x": [1]})) is None and dataset_prompts(None) is None


# --- in the trainer, before TRL's constructor (which loads the model and starts vLLM) ---
@pytest.fixture
def no_model_load(monkeypatch):
    import trl

    def refuse(*a, **kw):
        raise AssertionError("TRL's constructor ran: the model would load")

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", refuse)


def _args(tmp_path, **overrides):
    from triage_trl.trainer import TriageGRPOConfig

    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  vllm_max_model_length=32)  # TRIAGE full with the colocated vLLM sampler: TRL's quickstart config
    kwargs.update(overrides)
    return TriageGRPOConfig(**kwargs)


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        (["What is 1 + 1?", ""], "train_dataset row 1: the prompt is empty"),
        ([1, 2], "train_dataset row 0: the prompt is not text but int"),
        (["What is 1 + 1?", None], "train_dataset row 1: the prompt is not text but NoneType"),
        (["What is 1 + 1?", "1 + 1 = 2. " * 40], r"train_dataset row 1: the prompt has \d+ tokens, which leaves no "
                                                 "room for a completion in the context of 32 tokens"),
    ],
    ids=["empty", "int", "none", "too-long"],
)
def test_trainer_refuses_bad_prompts_before_the_model_loads(tmp_path, tiny_qwen3_dir, no_model_load, prompts, match):
    from triage_trl.trainer import TriageGRPOTrainer

    with pytest.raises(PromptError, match=match):
        TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward, args=_args(tmp_path),
                          train_dataset=Dataset.from_dict({"prompt": prompts}))


def test_trainer_checks_the_calibration_prompts(tmp_path, tiny_qwen3_dir, no_model_load):
    from triage_trl.trainer import TriageGRPOTrainer

    args = _args(tmp_path, sampler_precision="nvfp4", learner_precision="nvfp4", nvfp4_calibration_prompts=2)
    with pytest.raises(PromptError, match="calibration_dataset row 1: the prompt is not text but NoneType"):
        TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["What is 1 + 1?"]}),
                          calibration_dataset=[{"prompt": "What is 2 + 2?"}, {"prompt": None}])


# --- on the command line: status 2, one line ---
def _last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"question": "What is 2 + 3?", "solution": "5"}, {"question": "", "solution": "1"}],
         "row 1: the prompt is empty"),
        ([{"question": 12, "solution": "5"}], "row 0: the prompt is not text but int"),
        ([{"question": "What is 2 + 3?", "solution": "5"}, {"question": None, "solution": "1"}],
         "row 1: the prompt is not text but NoneType"),
    ],
    ids=["empty", "int", "none"],
)
def test_cli_refuses_bad_prompts_with_status_2(tmp_path, capsys, rows, match):
    from triage_trl.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--config", "tiny_cpu", "--output_dir", str(tmp_path / "run"), "--dataset_name", str(data),
            "--dataset_column_map", '{"question": "prompt", "solution": "answer"}', "--answer_kind", "math",
            "--reward_funcs", "verified_answer_reward", "--report_to", "none"]
    assert main(argv) == 2
    line = _last_line(capsys)
    assert line.startswith("triage-grpo: error: ") and match in line


def test_cli_refuses_a_prompt_longer_than_the_context(tmp_path, capsys):
    from triage_trl.cli import main

    argv = ["--config", "tiny_cpu", "--output_dir", str(tmp_path / "run"), "--vllm_max_model_length", "8",
            "--report_to", "none"]
    assert main(argv) == 2
    line = _last_line(capsys)
    assert "train_dataset row 0: the prompt has" in line and "context of 8 tokens" in line
    assert "raise --vllm_max_model_length" in line


def test_prompts_a_template_cannot_render_are_not_measured():
    class TextOnlyTemplate:
        def apply_chat_template(self, messages, **kwargs):
            raise TypeError("can only concatenate str (not list)")

        def __call__(self, text, **kwargs):
            raise AssertionError("not measured")

    multimodal = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]]
    check_prompts(multimodal, tokenizer=TextOnlyTemplate(), context_tokens=4)  # TRL's processor renders them
    tool_turn = [[{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": None}]]
    check_prompts(tool_turn)
