"""The TRL contract (``triage_trl/trainer/trl_contract.py``): every TRL name, attribute, batch key and behaviour the
project relies on exists in the installed TRL; a missing one fails here first, with a message naming it and its use."""

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
