"""The TRL contract (``triage_trl/trainer/trl_contract.py``): every TRL name, attribute, batch key and behaviour the
project relies on exists in the installed TRL; a missing one fails here first, with a message naming it and its use."""

import contextlib

import pytest
import trl

from triage_trl.trainer.trl_contract import TRL_CONTRACT, Requirement, check_trl_contract
from triage_trl.trainer.trl_seam import TRLContractError


def test_installed_trl_meets_the_contract():
    assert trl.__version__.startswith("1.16.")
    check_trl_contract()


@pytest.mark.parametrize("req", TRL_CONTRACT, ids=lambda r: r.target)
def test_each_requirement_says_where_it_is_used(req):
    assert req.used_by and ":" in req.target


def test_a_name_taken_away_fails_clearly(monkeypatch):
    import trl.trainer.grpo_trainer as grpo_module

    monkeypatch.delattr(grpo_module, "VLLMGeneration")
    with pytest.raises(TRLContractError) as info:
        check_trl_contract()
    message = str(info.value)
    assert "trl.trainer.grpo_trainer:VLLMGeneration is missing" in message
    assert "TRL instantiates its vLLM backend through this module name" in message
    assert "install trl>=1.16,<1.17" in message


def test_a_changed_behaviour_fails_clearly(monkeypatch):
    from trl import GRPOTrainer

    def _compute_loss(self, model, inputs):  # a TRL whose loss no longer reads the importance-sampling ratio
        return 0.0

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", _compute_loss)
    with pytest.raises(TRLContractError, match=r"_compute_loss no longer contains .*importance_sampling_ratio"):
        check_trl_contract()


def test_trainer_checks_the_contract_before_loading_a_model(monkeypatch, tmp_path):
    import trl.trainer.grpo_trainer as grpo_module

    from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer

    args = TriageGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    monkeypatch.delattr(grpo_module, "VLLMGeneration")
    with pytest.raises(TRLContractError, match="VLLMGeneration is missing"):
        TriageGRPOTrainer("no/such-model-is-loaded", reward_funcs=lambda completions, **kw: [0.0], args=args)


def test_requirement_on_an_unknown_module_is_reported():
    with pytest.raises(TRLContractError, match="trl.no_such_module:Thing is missing"):
        check_trl_contract((Requirement("trl.no_such_module:Thing", "nothing"),))


def test_compact_fused_lm_head_on_cpu_is_scoped_and_cpu_only():
    import torch
    import trl.trainer.utils as trl_utils

    from triage_trl.trainer.trl_seam import compact_fused_lm_head_on_cpu

    original = trl_utils._use_triton
    assert original(torch.device("cpu")) is False  # TRL scores every position on CPU by itself
    with compact_fused_lm_head_on_cpu():
        assert trl_utils._use_triton(torch.device("cpu")) is True
        assert trl_utils._use_triton(torch.device("meta")) is original(torch.device("meta"))
    assert trl_utils._use_triton is original
    with pytest.raises(RuntimeError, match="boom"), compact_fused_lm_head_on_cpu():
        raise RuntimeError("boom")
    assert trl_utils._use_triton is original


def test_compact_fused_lm_head_gives_the_same_log_probs_entropies_and_gradients(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from triage_trl.testing import save_tiny_qwen3
    from triage_trl.trainer.trl_seam import compact_fused_lm_head_on_cpu

    save_tiny_qwen3(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (4, 24), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[0, :5] = 0  # a left-padded prompt
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :-7] = -100  # only the last 7 tokens (the completion) are scored

    def score(compact: bool):
        model.zero_grad()
        with compact_fused_lm_head_on_cpu() if compact else contextlib.nullcontext():
            out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
        logps, entropy = out.log_probs[:, -7:], out.entropy[:, -7:]
        (logps.sum() + 0.1 * entropy.sum()).backward()
        return logps.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full, compact = score(False), score(True)
    torch.testing.assert_close(compact[0], full[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(compact[1], full[1], atol=1e-6, rtol=1e-6)
    assert len(compact[2]) == len(full[2]) > 0
    for got, expected in zip(compact[2], full[2]):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
