"""Non-finite rewards stop the run, naming the reward function (``triage_trl.trainer.reward_checks``), instead of
training on zero advantages."""

from __future__ import annotations

import math

import pytest
import torch

from triage_trl.trainer.reward_checks import NonFiniteRewardError, check_rewards

NAN, INF = math.nan, math.inf


def _r(*columns):
    return torch.tensor(list(zip(*columns)), dtype=torch.float32)


def test_finite_rewards_pass_and_the_missing_share_is_returned():
    assert check_rewards(_r([1.0, 0.0, 1.0, 0.0]), names=["acc"], num_generations=2) == 0.0
    # a None from one function is fine when another scores the completion; a completion nobody scores is counted
    assert check_rewards(_r([NAN, NAN, 1.0, 0.0], [1.0, NAN, NAN, 0.5]), names=["a", "b"], num_generations=2) == 0.25


@pytest.mark.parametrize("bad", [NAN], ids=["nan-or-none"])
def test_no_finite_reward_in_the_batch_names_the_function(bad):
    with pytest.raises(NonFiniteRewardError) as info:
        check_rewards(_r([bad] * 4, [NAN] * 4), names=["broken_reward", "other"], num_generations=2, step=3)
    message = str(info.value)
    assert message.startswith("No completion of this batch at step 3 has a finite reward: reward function(s) "
                              "broken_reward, other returned NaN or None for all 4 completions")
    assert "Return a float for each completion" in message


@pytest.mark.parametrize("bad", [INF, -INF], ids=["+inf", "-inf"])
def test_an_infinite_reward_names_the_function(bad):
    with pytest.raises(NonFiniteRewardError, match=r"Reward function inf_reward returned an infinite reward for 1 of 4 "
                                                   r"completions at step 0: return finite floats"):
        check_rewards(_r([1.0] * 4, [0.0, bad, 0.0, 1.0]), names=["fine", "inf_reward"], num_generations=2, step=0)


def test_rewards_whose_std_overflows_are_refused():
    with pytest.raises(NonFiniteRewardError, match=r"overflow float32 when their sum or standard deviation is computed "
                                                   r"\(reward function huge returned \|r\| up to 1e\+38\): rescale"):
        check_rewards(_r([1e38, 0.0, 1e38, 0.0]), names=["huge"], num_generations=2)
    with pytest.raises(NonFiniteRewardError, match="overflow"):  # the weighted sum overflows
        check_rewards(_r([3e38, 3e38], [3e38, 3e38]), names=["a", "b"], num_generations=2)
    assert check_rewards(_r([1e15, 0.0, 1e15, 0.0]), names=["big"], num_generations=2) == 0.0


# --- in the trainer: TRL's _calculate_rewards, then the check; stops train() with the function's name ---
def _args(tmp_path):
    from triage_trl.trainer import TriageGRPOConfig

    return TriageGRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, report_to="none",
                            save_strategy="no", per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=4, max_steps=2, triage_mode="off", use_vllm=False,
                            model_init_kwargs={"dtype": torch.float32})


def none_reward(completions, **kwargs):
    return [None] * len(completions)


def inf_reward(completions, **kwargs):
    return [math.inf] + [0.0] * (len(completions) - 1)


def huge_reward(completions, **kwargs):
    return [1e38 * (i % 2) for i in range(len(completions))]


@pytest.mark.slow
@pytest.mark.parametrize(("reward", "match"), [
    (none_reward, "reward function\\(s\\) none_reward returned NaN or None for all 4 completions"),
    (inf_reward, "Reward function inf_reward returned an infinite reward for 1 of 4"),
    (huge_reward, "reward function huge_reward returned \\|r\\| up to 1e\\+38"),
], ids=["none", "inf", "1e38"])
def test_trainer_stops_on_non_finite_rewards(tmp_path, tiny_qwen3_dir, reward, match):
    from datasets import Dataset

    from triage_trl.trainer import TriageGRPOTrainer

    trainer = TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=reward, args=_args(tmp_path),
                                train_dataset=Dataset.from_dict({"prompt": ["What is 1 + 1?\n"] * 8}))
    with pytest.raises(NonFiniteRewardError, match=match):
        trainer.train()
    assert trainer.state.global_step == 0
