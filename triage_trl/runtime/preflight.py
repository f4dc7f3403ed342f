"""Checks the command lines run before any model loads, so bad input fails in one line that names the remedy.

* :func:`check_model_source`: a local folder with ``config.json``, or a Hub id the Hub (or its local cache) resolves;
* :func:`check_reward_columns`: every column a reward function requires is in the training data;
* :func:`check_prompts`: every prompt of the training (and calibration) data is non-empty text or chat messages, and
  leaves room in the context (``vllm_max_model_length``, else the model's ``max_position_embeddings``) for at least
  one completion token;
* :func:`quantization_config`: TRL's ``BitsAndBytesConfig`` for ``--load_in_4bit`` / ``--load_in_8bit`` where a run
  can use one, else a refusal that says why.

Source: TRL 1.16 ``trl/scripts/grpo.py`` (``get_quantization_config``) and ``GRPOTrainer._calculate_rewards`` (the
keyword arguments a reward function receives); ``huggingface_hub.hf_hub_download`` (cache fallback when offline).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable

# What TRL 1.16 passes to every reward function besides the dataset's columns (``prompt`` is passed as ``prompts``).
TRL_REWARD_ARGUMENTS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)


def check_model_source(name: str, *, revision: str | None = None) -> None:
    """Check that ``name`` is a local model folder or a Hub model this machine can reach (online, or in the cache).

    Fetches the Hub's ``config.json`` (kept in the Hub cache, where the model load finds it).

    Raises:
        FileNotFoundError: a local folder without ``config.json``; a name that is neither a folder nor a valid Hub id;
            a Hub id that cannot be resolved (offline and not cached, or no such repository/revision).
    """
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"Model folder {name} has no config.json: give a folder saved with "
                                    "`save_pretrained` (or `hf download <id> --local-dir <folder>`).")
        return
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        hf_hub_download(name, "config.json", revision=revision)
    except HFValidationError:
        raise FileNotFoundError(
            f"Model {name!r} is neither a local folder nor a valid Hub id: check the path (relative to "
            f"{os.getcwd()})."
        ) from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"Model {name!r} is not a local folder, the Hub cannot be reached and it is not in the Hub cache: download "
            f"it while online (`hf download {name}`), give a local folder, or use `smollm2-135m-instruct` or "
            "`tiny-qwen3` (no network)."
        ) from None
    except OSError as err:  # RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, HTTP errors
        message = f"Model {name!r} is not a local folder and the Hub does not serve it: {first_line(err)}"
        raise FileNotFoundError(message) from None


def first_line(err: BaseException) -> str:
    """The first line of an error's message (the exception's class name when the message is empty)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def required_columns(reward_func) -> list[str]:
    """The keyword arguments ``reward_func`` requires (no default) beyond what TRL passes every reward function: the
    dataset columns it reads. ``[]`` for reward models (``nn.Module``, Hub ids) and uninspectable callables."""
    if isinstance(reward_func, str) or not callable(reward_func) or hasattr(reward_func, "forward"):
        return []
    try:
        params = inspect.signature(reward_func).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params
            if p.kind in kinds and p.default is inspect.Parameter.empty and p.name not in TRL_REWARD_ARGUMENTS]


def check_reward_columns(reward_funcs: Iterable, columns: Iterable[str]) -> None:
    """Check that the training data holds every column the reward functions require.

    Raises:
        ValueError: a reward function requires a column the data lacks (names the function, the column and the
            columns there are).
    """
    columns = set(columns)
    for func in reward_funcs:
        missing = [c for c in required_columns(func) if c not in columns]
        if missing:
            name = getattr(func, "__name__", type(func).__name__)
            raise ValueError(
                f"Reward function {name} needs the column(s) {', '.join(missing)}, which the training data lacks (it "
                f"has {', '.join(sorted(columns))}): map a column with --dataset_column_map, set --answer_kind for "
                "`answer_kind`, or pick another reward."
            )


class PromptError(ValueError):
    """A prompt of the data cannot be sampled from; the message names the data set, the row and the fix."""


def _prompt_text(prompt, tokenizer):
    """``(text_or_None, problem_or_None)`` for one stored prompt (a str, or chat messages)."""
    if isinstance(prompt, str):
        return (prompt, None) if prompt.strip() else (None, "is empty")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        contents = [m.get("content") for m in prompt]  # None: an assistant turn with tool calls only
        if not all(c is None or isinstance(c, (str, list)) for c in contents):
            kinds = ", ".join(sorted({type(c).__name__ for c in contents if not isinstance(c, (str, list))}))
            return None, f"has a message whose content is not text ({kinds})"
        if not any(c.strip() if isinstance(c, str) else c for c in contents):
            return None, "is empty (every message's content is empty)"
        if tokenizer is None:
            return None, None
        try:
            return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True), None
        except Exception:  # e.g. image parts a text template cannot render: TRL's processor renders them
            return None, None
    if isinstance(prompt, (list, tuple)) and not prompt:
        return None, "is empty (no message)"
    return None, f"is not text but {type(prompt).__name__} ({repr(prompt)[:40]})"


def check_prompts(prompts: Iterable, *, what: str = "train_dataset", tokenizer=None,
                  context_tokens: int | None = None) -> None:
    """Check every prompt before any model loads: text (or chat messages with text content), not empty, and (with
    ``tokenizer`` and ``context_tokens``) shorter than the context, leaving at least one token for the completion.

    Args:
        prompts: the data set's ``prompt`` column (str prompts, or lists of ``{"role", "content"}`` messages).
        what: the data set's name in the message (``train_dataset``, ``calibration_dataset``).
        tokenizer: counts the tokens of each prompt as TRL renders it (chat messages through the chat template).
        context_tokens: the sampler's context, ``vllm_max_model_length`` (else the model's
            ``max_position_embeddings``).

    Raises:
        PromptError: one line naming the data set, the row, the problem and the fix.
    """
    for row, prompt in enumerate(prompts):
        text, problem = _prompt_text(prompt, tokenizer)
        if problem is not None:
            raise PromptError(f"{what} row {row}: the prompt {problem}: give every row a non-empty text prompt (or "
                              "chat messages with text content), or drop the row (e.g. dataset.filter).")
        if text is not None and tokenizer is not None and context_tokens is not None:
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if n >= context_tokens:
                raise PromptError(
                    f"{what} row {row}: the prompt has {n} tokens, which leaves no room for a completion in the "
                    f"context of {context_tokens} tokens: raise --vllm_max_model_length (up to the model's "
                    "max_position_embeddings), or shorten or drop the row."
                )


def context_tokens(args, model_config=None) -> int | None:
    """The context a prompt and its completion share: ``args.vllm_max_model_length`` with the vLLM sampler, else the
    model config's ``max_position_embeddings`` (``None`` when neither is known)."""
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_max_model_length", None):
        return int(args.vllm_max_model_length)
    value = getattr(model_config, "max_position_embeddings", None)
    return int(value) if value else None


def dataset_prompts(dataset) -> list | None:
    """The ``prompt`` column of a map-style ``datasets.Dataset`` (or list of rows); ``None`` when it has none or is
    iterable only (such data are checked by TRL as they stream)."""
    if dataset is None:
        return None
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None:
        if "prompt" not in column_names or not hasattr(dataset, "__len__"):
            return None
        return list(dataset["prompt"])
    if isinstance(dataset, (list, tuple)):
        return [row.get("prompt") for row in dataset if isinstance(row, dict) and "prompt" in row]
    return None


def quantization_config(model_args, training_args):
    """TRL's ``get_quantization_config(model_args)`` (a bitsandbytes ``BitsAndBytesConfig``, or ``None`` without
    ``load_in_4bit``/``load_in_8bit``), for runs that can train on a bitsandbytes base.

    Refused with the vLLM sampler: its start checkpoint and every weight sync are written from the learner's weights
    (bf16, or re-quantised to NVFP4), and bitsandbytes' packed 4/8-bit weights are neither, so the sampler would not
    sample the policy being trained. Refused with the NVFP4 learner: it replaces the base's linears by NVFP4 W4A4
    layers that quantise bf16 weights; a bitsandbytes base has none (two 4-bit formats for one weight). For 4-bit
    learner memory with TRIAGE use ``learner_precision=nvfp4`` (and ``--use_peft`` for LoRA).

    Raises:
        ValueError: the flags with the vLLM sampler or the NVFP4 learner.
        ImportError: bitsandbytes is not installed.
    """
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    flag = "--load_in_4bit" if model_args.load_in_4bit else "--load_in_8bit"
    if training_args.use_vllm:
        raise ValueError(
            f"{flag} (a bitsandbytes base) cannot feed the vLLM sampler: its checkpoint and weight syncs are written "
            "from the learner's bf16 weights (re-quantised to NVFP4 for an NVFP4 sampler), which a bitsandbytes base "
            "does not hold. For 4-bit learner memory use --learner_precision nvfp4 (with --use_peft for LoRA); for "
            "QLoRA without TRIAGE set --triage_mode off --use_vllm false."
        )
    if training_args.learner_precision == "nvfp4":
        raise ValueError(
            f"{flag} with --learner_precision nvfp4: the NVFP4 learner quantises bf16 linears itself, a bitsandbytes "
            "base has none. Pick one: --learner_precision bf16, or drop the bitsandbytes flag."
        )
    from transformers.utils import is_bitsandbytes_available

    if not is_bitsandbytes_available():
        raise ImportError(f"{flag} needs bitsandbytes, which is not installed: `pip install bitsandbytes`.")
    from trl import get_quantization_config

    return get_quantization_config(model_args)
