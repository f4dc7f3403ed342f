"""``dataset_name`` as a Hub id or a local dataset with a column mapping (``triage_trl.data.custom``); local files
only."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from triage_trl.cli import build_dataset, parse_args
from triage_trl.data.custom import custom_dataset
from triage_trl.runtime.preflight import check_reward_columns, required_columns
from triage_trl.rewards import REWARD_FUNCS, verified_answer_reward

ROWS = [
    {"question": "What is 2 + 3?", "solution": 5, "level": 1},
    {"question": "Simplify $\\frac{2}{4}$.", "solution": "\\frac{1}{2}", "level": 2},
    {"question": "What is 7 * 6?", "solution": 42, "level": 1},
]
MAP = {"question": "prompt", "solution": "answer"}
INSTRUCTION = "Put your final answer within \\boxed{}."


def _jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps({**r, "solution": str(r["solution"])}) + "\n" for r in rows))
    return str(path)


def test_jsonl_with_column_map_and_fixed_answer_kind(tmp_path):
    ds = custom_dataset(_jsonl(tmp_path / "train.jsonl"), column_map=MAP, answer_kind="math")
    assert ds.column_names == ["prompt", "answer", "level", "answer_kind"]
    assert ds[0]["prompt"] == [{"role": "user", "content": f"What is 2 + 3? {INSTRUCTION}"}]
    assert ds["answer"] == ["5", "\\frac{1}{2}", "42"] and ds["answer_kind"] == ["math"] * 3
    completions = [[{"role": "assistant", "content": "\\boxed{5}"}], [{"role": "assistant", "content": "\\boxed{0.5}"}],
                   [{"role": "assistant", "content": "\\boxed{41}"}]]
    assert verified_answer_reward(completions, ds["answer"], ds["answer_kind"]) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("suffix", [".json", ".parquet", ".csv"])
def test_other_file_types_and_numeric_answers_become_text(tmp_path, suffix):
    path = str(tmp_path / f"train{suffix}")
    table = Dataset.from_list(ROWS[::2])  # numeric solutions: 5, 42
    {".json": table.to_json, ".parquet": table.to_parquet, ".csv": table.to_csv}[suffix](path)
    ds = custom_dataset(path, column_map=MAP, prompt_format="as_is")
    assert ds["prompt"] == ["What is 2 + 3?", "What is 7 * 6?"]  # TRL's standard text prompts, unchanged
    assert ds["answer"] == ["5", "42"]


def test_save_to_disk_folders_and_data_file_folders(tmp_path):
    rows = [{**r, "solution": str(r["solution"])} for r in ROWS]
    DatasetDict({"train": Dataset.from_list(rows[:2]), "test": Dataset.from_list(rows[2:])}).save_to_disk(
        str(tmp_path / "dict"))
    assert custom_dataset(str(tmp_path / "dict"), split="test", column_map=MAP)["answer"] == ["42"]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert len(custom_dataset(str(tmp_path / "one"), column_map=MAP)) == 3
    (tmp_path / "files").mkdir()
    _jsonl(tmp_path / "files" / "train.jsonl", ROWS[:1])
    _jsonl(tmp_path / "files" / "test.jsonl", ROWS[1:])
    assert custom_dataset(str(tmp_path / "files"), split="test", column_map=MAP)["answer"] == ["\\frac{1}{2}", "42"]
    with pytest.raises(ValueError, match="no split 'validation': set --dataset_train_split to one of train, test"):
        custom_dataset(str(tmp_path / "dict"), split="validation", column_map=MAP)


def test_chat_prompts_are_kept_and_subsets_are_seeded(tmp_path):
    chats = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(10)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chats))
    a = custom_dataset(str(path), size=4, seed=1)
    assert len(a) == 4 and a["prompt"][0] == [{"role": "user", "content": f"q{a['answer'][0]}"}]
    assert custom_dataset(str(path), size=4, seed=1)["answer"] == a["answer"]
    assert custom_dataset(str(path), size=4, seed=2)["answer"] != a["answer"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"column_map": {"problem": "prompt"}}, ValueError, "names problem, which .* lacks"),
        ({}, ValueError, "has no 'prompt' column .* --dataset_column_map"),
        ({"column_map": {"question": "prompt", "level": "solution"}}, ValueError, "renames to solution, which"),
        ({"column_map": MAP, "answer_kind": "poetry"}, ValueError, "answer_kind='poetry'"),
        ({"column_map": MAP, "split": "test"}, ValueError, "holds one split"),
        ({"column_map": MAP, "size": 9}, ValueError, "between 1 and the 3 rows"),
        ({"column_map": MAP, "prompt_format": "raw"}, ValueError, "prompt_format='raw'"),
    ],
)
def test_bad_mappings_are_refused(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        custom_dataset(_jsonl(tmp_path / "train.jsonl"), **kwargs)


def test_missing_paths_and_unknown_file_types(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        custom_dataset("./no/such.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unknown file type"):
        custom_dataset(str(tmp_path / "x.txt"))


def test_offline_hub_dataset_is_one_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="'nobody/no-such-dataset-x1' is not a local path and cannot be loaded"):
        custom_dataset("nobody/no-such-dataset-x1")


def test_cli_flags_build_the_dataset_and_check_the_rewards(tmp_path):
    path = _jsonl(tmp_path / "train.jsonl")
    base = ["--config", "tiny_cpu", "--output_dir", str(tmp_path / "run"), "--dataset_name", path, "--dataset_size",
            "2", "--dataset_column_map", json.dumps(MAP)]
    script, _, _ = parse_args([*base, "--answer_kind", "math"])
    assert script.dataset_column_map == MAP
    ds = build_dataset(script)
    assert len(ds) == 2 and ds["answer_kind"] == ["math", "math"]
    check_reward_columns([verified_answer_reward, REWARD_FUNCS["format_reward"]], ds.column_names)
    script, _, _ = parse_args(base)  # no --answer_kind: verified_answer_reward cannot score
    with pytest.raises(ValueError, match="verified_answer_reward needs the column.* answer_kind.*--answer_kind"):
        check_reward_columns([verified_answer_reward], build_dataset(script).column_names)
    assert required_columns(REWARD_FUNCS["accuracy_reward"]) == ["solution"]  # TRL's reward reads `solution`
    assert required_columns(REWARD_FUNCS["digit_share_reward"]) == []


def test_builtins_stay(tmp_path):
    script, _, _ = parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path)])
    assert build_dataset(script).column_names == ["prompt", "answer"]
    script, _, _ = parse_args(["--config", "tiny_cpu", "--output_dir", str(tmp_path), "--dataset_name", "math",
                               "--dataset_path", _jsonl(tmp_path / "m.jsonl", []), "--dataset_size", "1"])
    with pytest.raises(ValueError, match="size=1 must be between 1 and the 0 rows"):
        build_dataset(script)
