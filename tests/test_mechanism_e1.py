"""E1, the mechanism test (docs/stability.md, "E1: the mechanism"): the measurements on hand-computed values, the
arms' objectives, the paired report on synthetic results, and the smoke mode end to end (slow: real vLLM)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from triage_trl.lab.configs import scale_preset
from triage_trl.lab.mechanism import (ARMS, MEASURES, PERMUTED_ARMS, batch_quadrants, engine_moves, mismatch_stats,
                                      paired_bootstrap, permute_within_groups, trl_importance_ratio)
from script_module import load_script  # noqa: E402


def _script():
    return load_script("benchmarks/mechanism_e1.py")


def test_mismatch_stats_hand_computed():
    learner = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]])
    sampler = torch.tensor([[-0.5, -1.5, -1.0, -9.0], [-2.0, -1.0, float("nan"), -2.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv = torch.tensor([-1.0, 1.0])
    quadrants = batch_quadrants(learner, sampler, adv, mask)
    # gaps on measured tokens: row 0: -0.5, +0.5, 0 ; row 1: 0, -1.0, (nan: unmeasured), 0
    assert quadrants["NA"].tolist() == [[True, False, False, False], [False] * 4]
    assert quadrants["NC"].tolist() == [[False, True, False, False], [False] * 4]
    assert quadrants["PC"].tolist() == [[False] * 4, [False, True, False, False]]
    assert not quadrants["PA"].any()
    stats = mismatch_stats(learner, sampler, mask, quadrants)
    gaps = [-0.5, 0.5, 0.0, 0.0, -1.0, 0.0]
    assert stats["k3"] == pytest.approx(sum(math.expm1(g) - g for g in gaps) / 6)
    assert stats["gap_mean"] == pytest.approx(-1.0 / 6)
    assert stats["p99_abs_gap"] == 1.0  # ceil(0.99 * 6) = 6th smallest |gap|
    assert (stats["gap_NA"], stats["gap_NC"], stats["gap_PC"]) == (-0.5, 0.5, -1.0)
    assert math.isnan(stats["gap_PA"]) and stats["n_PA"] == 0 and stats["n_NA"] == 1
    # zero-signal rows join no quadrant
    assert not batch_quadrants(learner, sampler, adv, mask, torch.tensor([True, True]))["NA"].any()


def test_engine_moves_hand_computed():
    learner0 = torch.tensor([[-1.0, -2.0, -3.0]])
    sampler0 = torch.tensor([[-1.5, -2.0, float("nan")]])
    learner1 = torch.tensor([[-0.5, -1.0, -9.0]])
    sampler1 = torch.tensor([[-1.5, -1.0, -3.0]])
    moves = engine_moves(learner0, sampler0, learner1, sampler1, torch.tensor([[1, 1, 1]]))
    # the third token is unmeasured (sampler NaN before): learner moved +0.5, +1.0; sampler 0, +1.0
    assert moves == {"learner_move": 0.75, "sampler_move": 0.5}
    before = mismatch_stats(learner0, sampler0, torch.tensor([[1, 1, 0]]), batch_quadrants(
        learner0, sampler0, torch.tensor([1.0]), torch.tensor([[1, 1, 0]])))
    after = mismatch_stats(learner1, sampler1, torch.tensor([[1, 1, 0]]), batch_quadrants(
        learner0, sampler0, torch.tensor([1.0]), torch.tensor([[1, 1, 0]])))
    assert after["gap_mean"] - before["gap_mean"] == pytest.approx(moves["learner_move"] - moves["sampler_move"])
    empty = engine_moves(learner0, sampler0, learner1, sampler1, torch.zeros(1, 3))
    assert math.isnan(empty["learner_move"]) and math.isnan(empty["sampler_move"])


def test_trl_importance_ratio_modes():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.0, 0.5, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    torch.testing.assert_close(trl_importance_ratio(old, sampler, mask, "token_truncate", None, 2.0),
                               torch.tensor([[2.0, math.exp(-0.5), 1.0]]))
    torch.testing.assert_close(trl_importance_ratio(old, sampler, mask, "token_mask", None, 2.0),
                               torch.tensor([[0.0, math.exp(-0.5), 1.0]]))
    torch.testing.assert_close(trl_importance_ratio(old, sampler, mask, "sequence_mask", None, 3.0),
                               torch.tensor([[math.exp(0.5)]]))
    torch.testing.assert_close(trl_importance_ratio(old, sampler, mask, "sequence_truncate", None, 1.5),
                               torch.tensor([[1.5]]))
    with pytest.raises(ValueError, match="Unknown vllm_importance_sampling_mode"):
        trl_importance_ratio(old, sampler, mask, "token", None, 2.0)


def test_permute_within_groups_keeps_each_groups_values():
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0, -1.0, -2.0, -3.0, -4.0])
    def seeded():
        return torch.Generator().manual_seed(3)

    permuted = permute_within_groups(adv, 4, seeded())
    assert sorted(permuted[:4].tolist()) == [1.0, 2.0, 3.0, 4.0]
    assert sorted(permuted[4:].tolist()) == [-4.0, -3.0, -2.0, -1.0]
    assert not torch.equal(permuted, adv)
    torch.testing.assert_close(permute_within_groups(adv, 4, seeded()), permuted)  # E1 seeds by the batch index
    assert permute_within_groups(adv[:, None], 4, seeded()).shape == (8, 1)
    with pytest.raises(ValueError, match="groups of 3"):
        permute_within_groups(adv, 3, seeded())
    assert PERMUTED_ARMS <= set(ARMS) and ARMS["naive_permuted"] == "nvfp4_naive"


def test_paired_bootstrap():
    result = paired_bootstrap([1.0, 2.0, 3.0, 4.0, math.nan])
    assert result["n"] == 4 and result["mean"] == 2.5
    assert 1.0 <= result["low"] < 2.5 < result["high"] <= 4.0
    assert paired_bootstrap([1.0, 2.0, 3.0, 4.0]) == result  # seeded: reproducible
    constant = paired_bootstrap([0.5] * 10)
    assert (constant["low"], constant["high"]) == (0.5, 0.5)
    one = paired_bootstrap([0.3])
    assert one["mean"] == 0.3 and math.isnan(one["low"])
    assert paired_bootstrap([])["n"] == 0


def test_every_arm_gets_its_lab_configurations_objective(tmp_path):
    fields = _script().arm_fields(scale_preset("smoke"), str(tmp_path), 0, "stress")
    assert list(fields) == list(ARMS) and list(ARMS)[0] == "naive"
    assert (fields["naive"]["triage_mode"], fields["naive"]["vllm_importance_sampling_correction"]) \
        == ("diagnose", False)
    tis = fields["tis"]
    assert (tis["vllm_importance_sampling_correction"], tis["vllm_importance_sampling_mode"],
            tis["vllm_importance_sampling_clip_max"]) == (True, "token_truncate", 2.0)
    assert fields["opsm"]["off_policy_mask_threshold"] == 0.5 and fields["opsm"]["triage_mode"] == "diagnose"
    assert fields["triage"]["triage_mode"] == "full" and fields["triage"]["triage_direction"] == "aware"
    assert fields["rebalance_only"]["triage_repair_mode"] == "none"
    assert fields["repair_only"]["triage_rebalance_floor"] == 1.0
    assert fields["direction_blind"]["triage_direction"] == "blind"
    assert all(f["off_policy_mask_threshold"] is None for a, f in fields.items() if a != "opsm")


def test_objective_context_switches_and_restores_the_trainer():
    from types import SimpleNamespace

    script = _script()
    args = SimpleNamespace(triage_mode="diagnose", off_policy_mask_threshold=None, vllm_importance_sampling_mode="x",
                           vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0)
    trainer = SimpleNamespace(args=args, triage_mode="diagnose", off_policy_mask_threshold=None,
                              vllm_importance_sampling_mode="x", vllm_importance_sampling_clip_min=None,
                              vllm_importance_sampling_clip_max=3.0)
    arm = dict(triage_mode="full", off_policy_mask_threshold=0.5, vllm_importance_sampling_mode="token_truncate",
               vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=2.0)
    with script.objective(trainer, arm):
        assert (trainer.args.triage_mode, trainer.triage_mode, trainer.off_policy_mask_threshold,
                trainer.vllm_importance_sampling_clip_max) == ("full", "full", 0.5, 2.0)
    assert (trainer.args.triage_mode, trainer.triage_mode, trainer.off_policy_mask_threshold,
            trainer.args.vllm_importance_sampling_clip_max) == ("diagnose", "diagnose", None, 3.0)


def test_report_pairs_each_arm_with_naive(tmp_path):
    script = _script()
    os.makedirs(tmp_path / "results")
    for b in range(3):
        for arm, k3 in (("naive", 0.1 + b), ("triage", 0.05 + b)):
            delta = {m: 0.0 for m in MEASURES}
            delta["k3"] = k3
            with open(tmp_path / "results" / f"b{b:03d}_{arm}.json", "w") as f:
                json.dump({"batch": b, "arm": arm, "delta": delta}, f)
    table = script.report(str(tmp_path))
    assert table["naive"]["batches"] == 3 and table["naive"]["k3"]["mean"] == pytest.approx(1.1)
    assert table["triage"]["k3_vs_naive"]["mean"] == pytest.approx(-0.05)
    assert table["triage"]["k3_vs_naive"]["low"] == pytest.approx(-0.05)
    text = (tmp_path / "report.md").read_text()
    assert "| triage | 3 | +1.0500 (-0.0500 [-0.0500, -0.0500])" in text
    assert (tmp_path / "e1_quadrants.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_mode_end_to_end_and_resume(tmp_path, capfd, in_process_vllm):
    """One batch x 7 arms on a tiny random Qwen3, then the run extended by a batch after its state.pt is deleted
    (resume by replaying the saved batch, as a committed run copied to a new machine does). The script's ``main``
    with its command line, in this process (four interpreter starts with vLLM's imports saved; a trainer in a
    process that has run others is what the close tests cover)."""
    script = _script()
    out = tmp_path / "e1"
    argv = ["--smoke", "--batches", "1", "--output-dir", str(out)]
    script.main(argv)
    run = out / "full"
    results = {p.name for p in (run / "results").iterdir()}
    assert results == {f"b000_{arm}.json" for arm in ARMS}
    records = {arm: json.loads((run / "results" / f"b000_{arm}.json").read_text()) for arm in ARMS}
    for arm, r in records.items():
        assert set(r["delta"]) == set(MEASURES) and math.isfinite(r["delta"]["k3"]), arm
        d = r["delta"]  # the mean gap's change is the learner's move minus the sampler's
        assert d["gap_mean"] == pytest.approx(d["learner_move"] - d["sampler_move"], abs=1e-5), arm
        assert math.isfinite(r["grad_norm"]) and r["before"] == records["naive"]["before"]  # one common start
        assert isinstance(r["native_bf16_gemm"], bool), arm
    assert records["tis"]["loss"] != records["naive"]["loss"]  # the arms' objectives reach the loss
    # permuted advantages: another gradient (the loss value at ratio 1 can tie when completions have equal lengths)
    assert records["naive_permuted"]["grad_norm"] != records["naive"]["grad_norm"]
    assert 0.0 <= records["opsm"]["opsm_dropped_frac"] <= 1.0
    saved = torch.load(run / "batches" / "b000.pt", weights_only=False)
    batch = saved["batch"]
    # the generation batch carries TRL's own ratio (the naive run's default mode): the mirror reproduces it
    torch.testing.assert_close(trl_importance_ratio(batch["old_per_token_logps"], batch["sampling_per_token_logps"],
                                                    batch["completion_mask"], "sequence_mask", None, 3.0),
                               batch["importance_sampling_ratio"])
    assert json.loads((run / "progress.json").read_text()) == {"next_batch": 1}
    assert "| direction_blind | 1 |" in (run / "report.md").read_text()

    script.main([*argv, "--nulls"])
    nulls = json.loads((run / "nulls.json").read_text())
    rows = nulls["batches"]
    assert [r["batch"] for r in rows] == ["b000.pt"] and rows[0]["tail_concentration"]["n_segments"] > 0
    pooled = nulls["pooled"]["tail_concentration"]  # one batch: the pooled test is the batch's own
    concentration = rows[0]["tail_concentration"]["observed"]
    if math.isnan(concentration):  # no tail token in the smoke batch (e.g. no learning signal): nothing to pool
        assert pooled["batches"] == 0
    else:
        assert pooled["batches"] == 1 and pooled["observed"] == concentration
    assert "| b000.pt |" in (run / "nulls.md").read_text()
    assert "| mean over " in (run / "nulls.md").read_text()

    capfd.readouterr()
    script.main(argv)
    assert "All 1 batches done." in capfd.readouterr().out

    # a committed run has no state.pt (1.6 GB at full fine-tuning): the extension replays naive's step over batch 0
    (run / "state.pt").unlink()
    script.main([*argv[:-4], "--batches", "2", "--arms", "naive", "tis", "--output-dir", str(out)])
    printed = capfd.readouterr().out
    assert "replaying naive's step over the 1 saved batches" in printed and "resuming at batch 1" in printed
    (check,) = json.loads((run / "replay.json").read_text())
    assert check["loss_diff"] == pytest.approx(0.0, abs=1e-4 * max(abs(check["loss_recorded"]), 1e-3))
    assert check["grad_norm_diff"] == pytest.approx(0.0, abs=1e-3 * check["grad_norm_recorded"])
    assert {p.name for p in (run / "results").iterdir()} == results | {"b001_naive.json", "b001_tis.json"}
    assert json.loads((run / "progress.json").read_text()) == {"next_batch": 2}


def test_learner_logps_match_the_full_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    from triage_trl.testing import save_tiny_qwen3

    save_tiny_qwen3(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (5, 20), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[0, :3] = 0  # a left-padded prompt
    got = _script().learner_logps(model, ids, attention, 7, 0.7, rows=2)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -8:-1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, -7:, None]).squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
