"""``triage-grpo`` / ``python -m triage_trl``: TRIAGE-GRPO training from a YAML recipe plus CLI overrides.

Parsed with TRL's ``TrlParser`` over (:class:`TriageScriptArguments`, :class:`TriageGRPOConfig`,
``trl.ModelConfig``), like TRL's own ``trl grpo``::

    accelerate launch --config_file accelerate_configs/cpu.yaml -m triage_trl --config recipes/tiny_cpu.yaml
    triage-grpo --config qwen3_4b_nvfp4_triage --max_steps 10

``--config`` takes a YAML file or the name of a recipe shipped with the package (``tiny_cpu``, ``qwen3_4b_*``, ...).
``model_name_or_path: tiny-qwen3`` builds a tiny random Qwen3 and its tokenizer offline into
``<output_dir>/tiny-qwen3`` (no hub access); ``smollm2-135m-instruct`` is the embedded default SmolLM2-135M-Instruct
(``triage_trl.models``). Datasets: the built-ins ``arith``, ``reasoning_gym``, ``gsm8k`` and ``math``
(``triage_trl.data``), or any Hub id or local file/folder with a column mapping (``triage_trl.data.custom``).
Rewards: the registry of ``triage_trl.rewards`` (ours and TRL's under TRL's names) or a dotted import path, the
working directory importable as under ``trl grpo``. Every input is checked before the model loads; a bad one ends
the command with one line naming the remedy (exit status 2).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field

from . import __version__
from .answers import KINDS
from .data.custom import PROMPT_FORMATS

BUILTIN_DATASETS = ("arith", "reasoning_gym", "gsm8k", "math")

DESCRIPTION = """\
Train a causal LM with GRPO and the TRIAGE objective: TRL's GRPOTrainer with a colocated vLLM sampler (bf16 or
NVFP4) and an NVFP4-capable learner. Settings come from a YAML recipe (--config FILE, or the name of a shipped
recipe such as tiny_cpu) and from flags, which win over the recipe. Every TriageGRPOConfig field (TRL's GRPOConfig
plus triage_*, NVFP4 and sampler settings), every TRL ModelConfig field and the script arguments below are flags.
The run folder (--output_dir) receives the model, its card, trainer_state.json and the plots of triage-report."""

EPILOG = """\
examples:
  # tiny offline smoke run on CPU: random tiny Qwen3, arithmetic task, NVFP4 learner and sampler
  triage-grpo --config tiny_cpu --output_dir runs/tiny_cpu --max_steps 3

  # your data and reward: a local jsonl with question/solution fields and my_rewards.py in this folder
  triage-grpo --model_name_or_path smollm2-135m-instruct --dataset_name train.jsonl \\
      --dataset_column_map '{"question": "prompt", "solution": "answer"}' --answer_kind math \\
      --reward_funcs verified_answer_reward my_rewards.brevity --output_dir runs/mine

  triage-trl env   # versions, vLLM platform and NVFP4 paths, to paste in a bug report"""


@dataclass
class TriageScriptArguments:
    """Script arguments of the TRIAGE-GRPO entry point (the data fields carry TRL's ``ScriptArguments`` names)."""

    dataset_name: str = field(
        default="arith",
        metadata={"help": "Training data. Built in: `arith` (synthetic arithmetic), `reasoning_gym` (embedded "
                  "default, no network), `gsm8k` (Hub id or local jsonl in dataset_path), `math` (MATH-style jsonl "
                  "in dataset_path). Anything else: a Hub dataset id, a folder (save_to_disk, or data files) or a "
                  ".json/.jsonl/.parquet/.csv file, with --dataset_column_map naming its prompt/answer columns."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration (`name=`)."})
    dataset_train_split: str = field(
        default="train", metadata={"help": "Split to train on (gsm8k: file name in a folder)."}
    )
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "gsm8k: a jsonl file, a folder with <split>.jsonl, or a Hub id (default openai/gsm8k); "
                  "math: the jsonl file (required)."},
    )
    dataset_column_map: dict | str | None = field(
        default=None,
        metadata={"help": "Hub id or local dataset: JSON object renaming columns to `prompt`, `answer` (and "
                  "`answer_kind`), e.g. '{\"question\": \"prompt\", \"solution\": \"answer\"}'."},
    )
    answer_kind: str | None = field(
        default=None,
        metadata={"help": "Hub id or local dataset: a fixed `answer_kind` column for verified_answer_reward.",
                  "choices": list(KINDS)},
    )
    dataset_prompt_format: str = field(
        default="boxed_chat",
        metadata={"help": "Hub id or local dataset: `boxed_chat` turns a text prompt into one user message asking "
                  "for the final answer in \\boxed{}; `as_is` keeps TRL's standard text prompt. Chat prompts are "
                  "kept either way.", "choices": list(PROMPT_FORMATS)},
    )
    reasoning_gym_task: str | None = field(
        default=None,
        metadata={"help": "reasoning_gym: the task as JSON, e.g. '{\"name\": \"chain_sum\", \"min_terms\": 2, "
                  "\"max_terms\": 3}'. Unset: triage_trl.data.DEFAULT_TASK."},
    )
    dataset_size: int | None = field(
        default=64,
        metadata={"help": "Number of prompts (arith, reasoning_gym: generated; otherwise a seeded subset; unset: "
                  "all); >= 1."},
    )
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the generated prompts or of the subset."})
    max_operand: int = field(default=20, metadata={"help": "Largest operand of the arithmetic prompts."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed_answer_reward"],
        metadata={
            "help": "Reward functions: names from triage_trl.rewards (`verified_answer_reward`, `format_reward`, "
            "`boxed_answer_reward`, `digit_share_reward`, `reasoning_gym_reward`, TRL's `accuracy_reward`, ...) or "
            "dotted import paths (`my_rewards.brevity`, importable from the working directory)."
        },
    )

    def __post_init__(self):
        if isinstance(self.dataset_column_map, str):
            try:
                self.dataset_column_map = json.loads(self.dataset_column_map)
            except json.JSONDecodeError as err:
                raise ValueError(f"dataset_column_map is not JSON ({err}): give an object such as "
                                 '\'{"question": "prompt"}\'.') from None
        mapping = self.dataset_column_map
        if mapping is not None and not (
            isinstance(mapping, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())
        ):
            raise ValueError(f"dataset_column_map must map column names to column names, got {mapping!r}.")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the flag help (as TrlParser shows them) and the examples laid out as written."""


def make_parser():
    """TRL's ``TrlParser`` over (script args, ``TriageGRPOConfig``, ``ModelConfig``), with a description, examples
    and ``--version``."""
    from trl import ModelConfig, TrlParser

    from .trainer import TriageGRPOConfig

    parser = TrlParser((TriageScriptArguments, TriageGRPOConfig, ModelConfig), prog="triage-grpo",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"triage-trl {__version__}")
    return parser


def resolve_recipe(path: str) -> str:
    """``path`` when it is a file, else the recipe of that name shipped in ``triage_trl/recipes`` (``tiny_cpu``,
    ``tiny_cpu.yaml`` or ``recipes/tiny_cpu.yaml``).

    Raises:
        FileNotFoundError: neither a file nor a shipped recipe (names the shipped ones).
    """
    if os.path.isfile(path):
        return path
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
    name = os.path.basename(path)
    shipped = os.path.join(folder, name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if os.path.isfile(shipped):
        return shipped
    names = sorted(f.removesuffix(".yaml") for f in os.listdir(folder) if f.endswith(".yaml"))
    raise FileNotFoundError(f"Recipe {path} does not exist: give a YAML file or a shipped recipe ({', '.join(names)}).")


def resolve_reward_funcs(names: list[str]) -> list:
    """Reward callables for ``names`` (registry names or dotted import paths).

    As in ``trl grpo``, the working directory is importable for dotted paths (a ``my_rewards.py`` next to the
    command), also under the ``triage-grpo`` console script, whose ``sys.path`` does not hold it.

    Raises:
        ValueError: a name is neither in the registry nor an importable ``module.function`` path.
    """
    from .answers.rewards import REWARD_FUNCS

    funcs = []
    for name in names:
        if name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
        elif "." in name:
            funcs.append(_import_reward(name))
        else:
            raise ValueError(
                f"Unknown reward function {name!r}: use one of {sorted(REWARD_FUNCS)} or a dotted import path."
            )
    return funcs


def _import_reward(path: str):
    module_name, attr = path.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(f"Reward function {path!r}: no module {err.name!r} in the working directory "
                         f"({os.getcwd()}) or the installed packages.") from None
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"Reward function {path!r}: module {module_name} has no function {attr!r}.")
    return getattr(module, attr)


def build_dataset(script_args: TriageScriptArguments):
    """The training ``datasets.Dataset`` named by ``script_args.dataset_name``: a built-in, or any Hub id or local
    dataset (``triage_trl.data.custom.custom_dataset``).

    Raises:
        ValueError: ``math`` without ``dataset_path``, ``reasoning_gym_task`` that is not a JSON object, or a
            custom dataset ``custom_dataset`` refuses.
        FileNotFoundError: a local path that does not exist, or a Hub dataset that cannot be loaded.
    """
    name = script_args.dataset_name
    if name == "arith":
        from .data.arith import arith_dataset

        return arith_dataset(script_args.dataset_size or 64, seed=script_args.dataset_seed,
                             max_operand=script_args.max_operand)
    if name not in BUILTIN_DATASETS:
        from .data.custom import custom_dataset

        return custom_dataset(name, config=script_args.dataset_config, split=script_args.dataset_train_split,
                              column_map=script_args.dataset_column_map, answer_kind=script_args.answer_kind,
                              prompt_format=script_args.dataset_prompt_format, size=script_args.dataset_size,
                              seed=script_args.dataset_seed)
    from .data import load_task

    task = None
    if script_args.reasoning_gym_task:
        task = json.loads(script_args.reasoning_gym_task)
        if not isinstance(task, dict):
            raise ValueError(f"reasoning_gym_task must be a JSON object with a 'name'; got {script_args.reasoning_gym_task!r}.")
    return load_task(name, path=script_args.dataset_path, split=script_args.dataset_train_split,
                     size=script_args.dataset_size, seed=script_args.dataset_seed, task=task)


@dataclass
class PreparedRun:
    """What :func:`prepare` checked and built before any model loads."""

    model_path: str
    dataset: object
    reward_funcs: list
    quantization_config: object | None


def prepare(script_args: TriageScriptArguments, training_args, model_args) -> PreparedRun:
    """Resolve and check every input of a run before the model loads: the model source, the rewards, the dataset
    (and that it holds every column the rewards require) and the quantization flags; set ``model_init_kwargs``.

    Raises:
        ValueError, FileNotFoundError, ImportError: a bad input, with the remedy (see
            :mod:`triage_trl.runtime.preflight`, :mod:`triage_trl.runtime.run_folder`, :func:`build_dataset`,
            :func:`resolve_reward_funcs`): a read-only or full ``output_dir``, one that already holds a run (unless
            resuming), an empty, non-text or too long prompt.
    """
    from .runtime.preflight import check_model_source, check_reward_columns, quantization_config
    from .runtime.run_folder import RunLock, check_output_dir, refuse_existing_run
    from .runs import resolve_model

    if not model_args.model_name_or_path:
        raise ValueError(
            "Set model_name_or_path: a Hub id, a local folder, `smollm2-135m-instruct` (the embedded default) or "
            "`tiny-qwen3` (a tiny offline model)."
        )
    check_output_dir(training_args.output_dir)
    if training_args.should_save:  # the main process takes the lock; the others would see it taken
        RunLock(training_args.output_dir).check()
    refuse_existing_run(training_args.output_dir, training_args.resume_from_checkpoint)
    quantization = quantization_config(model_args, training_args)
    reward_funcs = resolve_reward_funcs(script_args.reward_funcs)
    dataset = build_dataset(script_args)
    check_reward_columns(reward_funcs, dataset.column_names)
    # The embedded model is converted into a cache and tiny-qwen3 built on first use: once per node, the other
    # ranks wait and then read the finished files.
    with training_args.main_process_first(local=True, desc="resolve the model"):
        model_path = resolve_model(model_args.model_name_or_path, training_args.output_dir)
    check_model_source(model_path, revision=model_args.model_revision)
    _check_run_inputs(model_path, training_args, dataset)
    model_init_kwargs = {"dtype": model_args.dtype, "attn_implementation": model_args.attn_implementation,
                         "revision": model_args.model_revision}
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}
    return PreparedRun(model_path, dataset, reward_funcs, quantization)


def _check_run_inputs(model_path: str, training_args, dataset) -> None:
    """The output folder's free space against the model's size and every prompt against the context: the trainer's
    own checks (``triage_trl.trainer.run_checks``), here so that the command line ends with status 2."""
    from .trainer.run_checks import check_run_inputs

    check_run_inputs(model_path, training_args, train_dataset=dataset)


def build_trainer(script_args: TriageScriptArguments, training_args, model_args, prepared: PreparedRun | None = None):
    """The trainer of a run, not yet trained: checks the inputs (:func:`prepare`, unless given) and builds
    ``TriageGRPOTrainer``, whose vLLM engine starts in this process. Call it inside
    ``triage_trl.runtime.vllm_process_settings()``; close the trainer (``with trainer:``) when done."""
    from trl import get_peft_config

    from .trainer import TriageGRPOTrainer

    prepared = prepared or prepare(script_args, training_args, model_args)
    return TriageGRPOTrainer(
        model=prepared.model_path,
        reward_funcs=prepared.reward_funcs,
        args=training_args,
        train_dataset=prepared.dataset,
        peft_config=get_peft_config(model_args),
        quantization_config=prepared.quantization_config,
    )


def run(script_args: TriageScriptArguments, training_args, model_args, prepared: PreparedRun | None = None):
    """Train: check the inputs (:func:`prepare`, unless given), build the trainer, train, and save the model, its
    card, ``trainer_state.json`` and the report plots (``triage_trl.runs.finish_run``); the vLLM engine is closed at
    the end. Returns the (closed) trainer."""
    from .export.run_record import write_run_record
    from .runs import finish_run
    from .runtime import vllm_process_settings

    with vllm_process_settings():
        trainer = build_trainer(script_args, training_args, model_args, prepared)
        write_run_record(trainer)  # before training: triage-export reads it for checkpoint-N folders too
        with trainer:  # the engine is closed last: its teardown also ends torch.distributed's default group
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
            finish_run(trainer, dataset_name=script_args.dataset_name)
            trainer.accelerator.print(f"Model, card, trainer_state.json and plots saved to {training_args.output_dir}.")
            if training_args.push_to_hub:
                trainer.push_to_hub()
    return trainer


def configure_logging() -> None:
    """WARNING for every library, INFO for ``triage_trl`` (the NVFP4 learner layer and sampler kernel reports)."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("triage_trl").setLevel(logging.INFO)


HELP_HINT = "`triage-grpo --help` lists every field"


def _with_suggestions(message: str, parser: argparse.ArgumentParser) -> str:
    """TRL's parser's error for flags no field takes, with the closest known flag for each (``difflib``)."""
    if "arguments are not used" not in message:
        return message
    import difflib
    import re

    known = [option for action in parser._actions for option in action.option_strings]
    hints = [f"{flag} -> {close[0]}" for flag in re.findall(r"'(--[\w.-]+)'", message)
             if (close := difflib.get_close_matches(flag, known, n=1))]
    return f"{message}: did you mean {', '.join(hints)}?" if hints else f"{message} ({HELP_HINT})"


def parse_args(argv: list[str] | None = None):
    """``(script_args, training_args, model_args)`` from the command line; ``--config`` may name a shipped recipe.

    Raises:
        SystemExit: status 2 with one line for a bad recipe or field value (``--help``, ``--version``: status 0).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    # argparse's own errors (a value outside a field's choices, a missing value) as one line, not the whole usage
    parser.error = lambda message: parser.exit(2, f"triage-grpo: error: {message} ({HELP_HINT})\n")
    try:
        if "--config" in argv and argv.index("--config") + 1 < len(argv):
            i = argv.index("--config") + 1
            argv[i] = resolve_recipe(argv[i])
        return parser.parse_args_and_config(args=argv)
    except (ValueError, NotImplementedError, FileNotFoundError) as err:
        parser.exit(2, f"triage-grpo: error: {_with_suggestions(str(err), parser)}\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``triage-grpo`` and ``python -m triage_trl``; returns the exit status (0), or exits with status
    2 and one line when an input is bad (nothing loaded or written)."""
    script_args, training_args, model_args = parse_args(argv)
    configure_logging()
    try:
        prepared = prepare(script_args, training_args, model_args)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"triage-grpo: error: {err}", file=sys.stderr)
        return 2
    run(script_args, training_args, model_args, prepared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
