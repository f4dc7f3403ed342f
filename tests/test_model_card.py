"""The run's model card: Hub metadata read back with huggingface_hub, escaped tables, steps as logged, model-index.

Fast: no training; the trainer's own card is checked in test_trainer.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from huggingface_hub import ModelCard

from triage_trl import models
from triage_trl.eval.card import add_eval_results_to_card
from triage_trl.hub.card import TRIAGE_BIBTEX_KEY, base_model_info, md_cell
from triage_trl.trainer.model_card import TRIAGE_PAPER, build_model_card, mismatch_summary, triage_card_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGS = [  # TRL's log_history: one record per logged step, then the end-of-training summary
    {"step": 1, "loss": 0.1, "triage/gap_abs_mean": 0.5, "triage/k3_kl": 0.02, "triage/weight_mean": 1.0},
    {"step": 2, "loss": 0.2, "triage/gap_abs_mean": 0.4, "triage/k3_kl": 0.01, "triage/weight_mean": 0.9},
    {"step": 3, "loss": 0.3, "triage/gap_abs_mean": 0.3, "triage/k3_kl": 0.005, "triage/weight_mean": 0.8},
    {"step": 3, "train_runtime": 12.0, "train_loss": 0.2},
]


def table_rows(markdown: str) -> list[list[str]]:
    """Cells of every table row, split the way GitHub/the Hub split them (at unescaped `|`)."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def section(**overrides):
    kwargs = dict(triage_settings={"triage_mode": "full"},
                  nvfp4_settings={"nvfp4_exclude_patterns": [r"mlp\.(gate|up)_proj"], "note": "a`b"},
                  kernels={"sampler": "vLLM | NVFP4"}, log_history=LOGS, sync_probe_gaps=[0.01, 0.02])
    return triage_card_section(**{**kwargs, **overrides})


def card_for(model_path, tmp_path, **overrides):
    kwargs = dict(model_name="run", model_name_or_path=model_path, model_id=str(tmp_path / "run"),
                  trainer_name="TRIAGE-GRPO", paper=TRIAGE_PAPER, tags=["trl", "grpo", "triage", "nvfp4"],
                  triage_section=section(), dataset_name="openai/gsm8k")
    card = build_model_card(**{**kwargs, **overrides})
    card.save(tmp_path / "README.md")
    return ModelCard.load(tmp_path / "README.md")


def test_every_table_cell_is_escaped():
    text = section()
    rows = table_rows(text)
    assert rows and all(len(r) == len(rows[0]) or len(r) == 3 for r in rows)
    settings = {r[0]: r[1] for r in rows if len(r) == 2}
    assert settings["`nvfp4_exclude_patterns`"] == r"`['mlp\\.(gate\|up)_proj']`"
    assert settings["`note`"] == "``a`b``"
    assert md_cell("a\nb | c") == r"a b \| c"
    assert "vLLM \\| NVFP4" in text


def test_mismatch_steps_are_the_logged_steps():
    first, last = mismatch_summary(LOGS)
    assert (first["step"], last["step"]) == (1, 3)
    assert first["k3_kl"] == 0.02 and last["gap_abs_mean"] == 0.3 and last["weight_mean"] == 0.8
    rows = table_rows(section())
    assert ["metric", "step 1", "step 3"] in rows
    assert ["`triage/k3_kl`", "0.02", "0.005"] in rows
    assert mismatch_summary([{"step": 1, "loss": 0.3}]) is None


def test_embedded_smollm2_copy_names_its_hub_model_and_license(tmp_path):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    models.write_model_source(str(folder), model_id=models.SMOLLM2_HUB_ID, license=models.SMOLLM2_LICENSE,
                              note="dequantised from a GGUF")
    card = card_for(str(folder), tmp_path)
    data = card.data
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data.license == "apache-2.0" and data.datasets == ["openai/gsm8k"]
    assert data.pipeline_tag == "text-generation" and data.library_name == "transformers"
    assert {"trl", "grpo", "triage", "nvfp4", "generated_from_trainer"} <= set(data.tags)
    assert data.model_name == "run" and not hasattr(data, "licence")
    assert "[HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)" \
        in card.text and "dequantised from a GGUF" in card.text
    assert f'model="{tmp_path / "run"}"' in card.text
    assert "None" not in card.text
    assert f"@article{{{TRIAGE_BIBTEX_KEY}," in card.text and "## TRIAGE" in card.text
    assert card.text.index("## TRIAGE") < card.text.index("### Framework versions")


def test_local_folder_without_source_has_no_none_links(tmp_path):
    folder = tmp_path / "local"
    folder.mkdir()
    card = card_for(str(folder), tmp_path, dataset_name=None)
    assert card.data.base_model is None and card.data.license is None and card.data.datasets is None
    assert "huggingface.co/None" not in card.content and '"None"' not in card.content
    assert f"local checkpoint `{folder}`" in card.text


def test_hub_base_model_license_from_the_local_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--base" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (cache / "models--org--base" / "refs").mkdir()
    (cache / "models--org--base" / "refs" / "main").write_text("abc123")
    (snapshot / "README.md").write_text("---\nlicense: mit\n---\n# base\n")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert base_model_info("org/base") == {"base_model": "org/base", "license": "mit", "note": ""}
    assert base_model_info("org/uncached") == {"base_model": "org/uncached", "license": None, "note": ""}
    card = card_for("org/base", tmp_path)
    assert card.data.base_model == "org/base" and card.data.license == "mit"


def results_json(tmp_path, pass1_gsm8k=0.25, name="results.json"):
    results = {
        "config": {"model": "runs/x", "precision": "nvfp4", "backend": "vllm", "n": 1, "temperature": 0.0},
        "metrics": {"gsm8k": {"pass@1": pass1_gsm8k}, "math500": {"pass@1": 0.5}},
        "records": {"gsm8k": [{}] * 4, "math500": [{}] * 2},
    }
    path = tmp_path / name
    path.write_text(json.dumps(results))
    return str(path)


def test_eval_results_become_the_model_index(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    card_for(str(tmp_path), run)
    add_eval_results_to_card(str(run), results_json(tmp_path))
    add_eval_results_to_card(str(run), results_json(tmp_path, pass1_gsm8k=0.75))  # same settings: replaced
    card = ModelCard.load(run / "README.md")
    results = {(e.dataset_name, e.metric_type): e for e in card.data.eval_results}
    assert set(results) == {("gsm8k", "pass@1"), ("math500", "pass@1")}
    gsm8k = results["gsm8k", "pass@1"]
    assert gsm8k.metric_value == 75.0 and gsm8k.task_type == "text-generation"
    assert (gsm8k.dataset_type, gsm8k.dataset_config, gsm8k.dataset_split) == ("openai/gsm8k", "main", "test")
    assert gsm8k.metric_name == "pass@1 (greedy, nvfp4 vllm, 4 problems)"
    assert results["math500", "pass@1"].dataset_type == "HuggingFaceH4/MATH-500"
    assert "model-index:" in card.content and card.data.model_name == "run"
    assert card.text.count("## Evaluation") == 1
    assert ["gsm8k", "pass@1 (greedy, nvfp4 vllm, 4 problems)", "75.0"] in table_rows(card.text)
    assert card.data.base_model is None and "## TRIAGE" in card.text


def test_eval_results_errors_name_the_remedy(tmp_path):
    with pytest.raises(FileNotFoundError, match="train into it first"):
        add_eval_results_to_card(str(tmp_path), results_json(tmp_path))
    card_for(str(tmp_path), tmp_path)
    with pytest.raises(FileNotFoundError, match="triage-eval --output-dir"):
        add_eval_results_to_card(str(tmp_path), str(tmp_path / "missing.json"))
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a triage-eval results.json"):
        add_eval_results_to_card(str(tmp_path), str(tmp_path / "other.json"))


def test_one_citation_key_everywhere():
    import yaml

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme_keys = re.findall(r"@\w+\{([^,]+),", f.read())
    assert readme_keys == [TRIAGE_BIBTEX_KEY]
    with open(os.path.join(ROOT, "CITATION.cff"), encoding="utf-8") as f:
        cff = yaml.safe_load(f)
    assert cff["preferred-citation"]["title"] == TRIAGE_PAPER["title"]
    assert TRIAGE_BIBTEX_KEY in json.dumps(cff)


def test_tiny_model_card_names_its_license_and_no_base_model(tmp_path):
    """The tiny recipe's model is random weights made here: its run card carries the project's license and no
    `base_model` (it derives from none)."""
    from triage_trl.testing import save_tiny_qwen3

    model_dir = save_tiny_qwen3(tmp_path / "tiny-qwen3")
    run = tmp_path / "run"
    run.mkdir()
    card = card_for(str(model_dir), run)
    assert card.data.license == "apache-2.0" and card.data.base_model is None
    assert card.data.datasets == ["openai/gsm8k"]
