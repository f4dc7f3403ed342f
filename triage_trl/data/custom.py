"""Any prompt/answer dataset: a Hub id, a ``save_to_disk`` folder, a folder of data files, or one json/jsonl/parquet/
csv file, with its columns renamed to the ones TRIAGE's rewards read (``prompt``, ``answer``, ``answer_kind``).

The loading follows TRL's script arguments (``dataset_name``, ``dataset_config``, ``dataset_train_split``) through
``datasets.load_dataset`` / ``datasets.load_from_disk``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..answers import KINDS
from ..runtime.preflight import check_prompts, first_line
from .prompts import boxed_chat_prompt

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
PROMPT_FORMATS = ("boxed_chat", "as_is")


def custom_dataset(source: str, *, config: str | None = None, split: str = "train",
                   column_map: Mapping[str, str] | None = None, answer_kind: str | None = None,
                   prompt_format: str = "boxed_chat", size: int | None = None, seed: int = 0):
    """The ``split`` of ``source`` as a ``datasets.Dataset`` with a ``prompt`` column, ready for TRL's GRPO.

    Args:
        source: a Hub dataset id, a folder written by ``save_to_disk``, a folder of data files, or a ``.json``,
            ``.jsonl``, ``.parquet`` or ``.csv`` file.
        config: the Hub configuration (``load_dataset(source, name=config)``).
        split: the split to train on (a single file or a saved ``Dataset`` has one split, ``train``).
        column_map: ``{source column: new name}``, e.g. ``{"question": "prompt", "solution": "answer"}``.
        answer_kind: a fixed ``answer_kind`` column for ``triage_trl.rewards.verified_answer_reward`` (one of
            ``triage_trl.answers.KINDS``).
        prompt_format: ``"boxed_chat"``: a text prompt becomes one user message asking for the final answer in
            ``\\boxed{}`` (:func:`~triage_trl.data.prompts.boxed_chat_prompt`, no example turn); ``"as_is"``: kept as
            TRL's standard text prompt. Conversational prompts (lists of messages) are kept either way.
        size: keep this many rows after a seeded shuffle; ``None`` keeps all.
        seed: seed of that shuffle.

    Returns:
        The rows with ``prompt``, ``answer`` as str (when there is an answer column) and every other column.

    Raises:
        FileNotFoundError: a local path that does not exist, or a Hub id that cannot be loaded (offline and not
            cached, or no such dataset).
        triage_trl.runtime.preflight.PromptError: an empty or non-text prompt (names the row).
        ValueError: an unknown split or file type, a mapped column that is not there, no ``prompt`` column, an
            unknown ``answer_kind`` or prompt format, an ``answer_kind`` column next to ``answer_kind=``, or ``size``
            out of range.
    """
    from datasets import Value

    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format={prompt_format!r}: use one of {', '.join(PROMPT_FORMATS)}.")
    if answer_kind is not None and answer_kind not in KINDS:
        raise ValueError(f"answer_kind={answer_kind!r}: use one of {', '.join(KINDS)}.")
    ds = _load(source, config, split)
    ds = _rename(ds, dict(column_map or {}), source)
    if "prompt" not in ds.column_names:
        raise ValueError(f"{source} has no 'prompt' column (it has {', '.join(ds.column_names)}): map one with "
                         "--dataset_column_map, e.g. '{\"question\": \"prompt\"}'.")
    check_prompts(ds["prompt"], what=source)  # before the boxed_chat wrapping hides an empty question
    if size is not None:
        if not 1 <= size <= len(ds):
            raise ValueError(f"dataset_size={size} must be between 1 and the {len(ds)} rows of {source}.")
        ds = ds.shuffle(seed=seed).select(range(size))
    if "answer" in ds.column_names and getattr(ds.features["answer"], "dtype", None) != "string":
        features = ds.features.copy()
        features["answer"] = Value("string")
        ds = ds.map(lambda row: {"answer": str(row["answer"])}, features=features)
    if prompt_format == "boxed_chat":
        ds = ds.map(lambda row: {"prompt": boxed_chat_prompt(row["prompt"], example=None)
                                 if isinstance(row["prompt"], str) else row["prompt"]})
    if answer_kind is not None:
        if "answer_kind" in ds.column_names:
            raise ValueError(f"{source} already has an 'answer_kind' column: drop --answer_kind, or map that column "
                             "to another name.")
        ds = ds.add_column("answer_kind", [answer_kind] * len(ds))
    return ds


def _load(source: str, config: str | None, split: str):
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    path = os.path.expanduser(source)
    if os.path.isfile(path):
        builder = FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise ValueError(f"{source}: unknown file type; use one of {', '.join(FILE_BUILDERS)} or a folder.")
        _one_split(split, source)
        return load_dataset(builder, data_files=path, split="train")
    if os.path.isdir(path):
        if _saved_to_disk(path):
            ds = load_from_disk(path)
            if isinstance(ds, DatasetDict):
                return _pick(ds, split, source)
            _one_split(split, source)
            return ds
        return _pick(load_dataset(path, name=config), split, source)
    if source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"Dataset {source} does not exist: give a file ({', '.join(FILE_BUILDERS)}), a folder "
                                "or a Hub id.")
    try:
        loaded = load_dataset(source, name=config)
    except (ConnectionError, FileNotFoundError) as err:  # offline and not cached; DatasetNotFoundError
        raise FileNotFoundError(f"Dataset {source!r} is not a local path and cannot be loaded from the Hub "
                                f"({first_line(err)}): "
                                "download it while online, or give a local file or folder.") from None
    return loaded if isinstance(loaded, Dataset) else _pick(loaded, split, source)


def _saved_to_disk(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))


def _pick(splits, split: str, source: str):
    if split not in splits:
        raise ValueError(f"{source} has no split {split!r}: set --dataset_train_split to one of {', '.join(splits)}.")
    return splits[split]


def _one_split(split: str, source: str) -> None:
    if split != "train":
        raise ValueError(f"{source} holds one split (train), not {split!r}: drop --dataset_train_split.")


def _rename(ds, column_map: dict[str, str], source: str):
    missing = [c for c in column_map if c not in ds.column_names]
    if missing:
        raise ValueError(f"--dataset_column_map names {', '.join(missing)}, which {source} lacks (it has "
                         f"{', '.join(ds.column_names)}).")
    clash = [new for new in column_map.values() if new in ds.column_names and new not in column_map]
    if clash:  # e.g. question -> prompt while a `prompt` column stays
        raise ValueError(f"--dataset_column_map renames to {', '.join(clash)}, which {source} already has: map that "
                         f"column away too, e.g. '{{\"{clash[0]}\": \"{clash[0]}_original\"}}'.")
    return ds.rename_columns(column_map) if column_map else ds
