"""``push_to_hub`` uploads the trained model, not the sampler's start folder.

The sampler's structural checkpoint (config, tokenizer, empty weights, written when the engine starts) lives in
``<output_dir>/_sampler_checkpoint``; ``Trainer.push_to_hub`` and the pushes during training skip ``_*``. Checked
through transformers' own upload path with the Hub calls replaced (no network).
"""

import os

import pytest
from huggingface_hub import HfApi, RepoUrl
from huggingface_hub.utils import filter_repo_objects

from triage_trl.testing import save_tiny_qwen3
from triage_trl.trainer.distributed import SAMPLER_CHECKPOINT, sampler_checkpoint_dir


@pytest.fixture
def uploads(monkeypatch):
    """The repo paths each ``upload_folder`` call would upload, filtered by its patterns as huggingface_hub does
    (``filter_repo_objects``)."""
    commits = []
    monkeypatch.setattr(HfApi, "create_repo",
                        lambda self, repo_id, **kw: RepoUrl(f"https://huggingface.co/{repo_id}"))

    def upload_folder(self, *, folder_path, allow_patterns=None, ignore_patterns=None, **kw):
        files = [os.path.relpath(os.path.join(root, f), folder_path)
                 for root, _, names in os.walk(folder_path) for f in names]
        commits.append(sorted(filter_repo_objects(files, allow_patterns=allow_patterns,
                                                  ignore_patterns=ignore_patterns)))

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return commits


def test_push_to_hub_skips_the_sampler_start_checkpoint(tmp_path, uploads):
    from transformers import AutoModelForCausalLM, Trainer

    from triage_trl.trainer import TriageGRPOConfig

    model_dir = save_tiny_qwen3(tmp_path / "model")
    args = TriageGRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, report_to="none",
                            hub_model_id="me/tiny-run")
    start = sampler_checkpoint_dir(args, None)
    assert start == os.path.join(args.output_dir, SAMPLER_CHECKPOINT) and SAMPLER_CHECKPOINT.startswith("_")
    save_tiny_qwen3(start)  # stands for the engine's start files
    # TriageGRPOTrainer does not override push_to_hub: transformers' Trainer.push_to_hub is the code under test
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args)
    trainer.push_to_hub()
    assert len(uploads) == 1
    assert "model.safetensors" in uploads[0] and "config.json" in uploads[0]
    assert not [p for p in uploads[0] if "sampler_checkpoint" in p]
    old_default = os.path.join("sampler_checkpoint", "model.safetensors")  # the folder's name before this fix
    assert list(filter_repo_objects([old_default], ignore_patterns=["_*", "checkpoint-*"])) == [old_default]
