"""Progress bars of calibration, export and conversion: shown on each node's main process, hidden elsewhere."""

import torch

from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.learner import convert_to_nvfp4_learner
from triage_trl.runtime.progress import progress


def test_bar_on_the_local_main_process_only(monkeypatch, capfd):
    monkeypatch.delenv("TRIAGE_TRL_NO_PROGRESS", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert list(progress(range(3), desc="rank one", unit="x")) == [0, 1, 2]
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert list(progress(range(3), desc="rank zero", unit="x")) == [0, 1, 2]
    err = capfd.readouterr().err
    assert "rank zero" in err and "rank one" not in err


def test_conversion_shows_its_bar(monkeypatch, capfd, tmp_path):
    from transformers import AutoModelForCausalLM

    from triage_trl.testing import save_tiny_qwen3

    monkeypatch.delenv("TRIAGE_TRL_NO_PROGRESS", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    model = AutoModelForCausalLM.from_pretrained(save_tiny_qwen3(tmp_path / "tiny"), dtype=torch.float32)
    convert_to_nvfp4_learner(model, NVFP4Config(learner_precision="nvfp4"))
    assert "NVFP4 learner layers" in capfd.readouterr().err
