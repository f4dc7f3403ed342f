"""One rule decides which sampling settings keep the sampler's log-probs comparable with the learner's
(``triage_trl/trainer/sampling_rules.py``); the config applies it before any model loads."""

import pytest

from triage_trl.trainer.sampling_rules import (
    IncomparableSamplingError,
    check_comparable_sampling,
    check_generation_kwargs,
)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1.0, "repetition_penalty": 1.1}, "repetition_penalty=1.1"),
        ({"temperature": 1.0, "top_k": 50}, "top_k=50"),
        ({"temperature": 1.0, "top_p": 0.9}, "top_p=0.9"),
        ({"temperature": 1.0, "min_p": 0.05}, "min_p=0.05"),
        ({"temperature": 1.0, "generation_kwargs": {"presence_penalty": 0.5}}, "presence_penalty=0.5"),
        ({"temperature": 1.0, "generation_kwargs": {"frequency_penalty": 0.2}}, "frequency_penalty=0.2"),
        ({"temperature": 1.0, "generation_kwargs": {"logit_bias": {3: 1.0}}}, "logit_bias"),
        ({"temperature": 1.0, "generation_kwargs": {"bad_words": ["x"]}}, "bad_words"),
        ({"temperature": 1.0, "generation_kwargs": {"min_tokens": 4}}, "min_tokens=4"),
        ({"temperature": 1.0, "structured_outputs_regex": "[0-9]+"}, "structured_outputs"),
    ],
)
def test_incomparable_sampling_settings_are_refused(kwargs, match):
    with pytest.raises(IncomparableSamplingError, match=match):
        check_comparable_sampling(**kwargs)


def test_message_names_what_compares_the_log_probs():
    with pytest.raises(IncomparableSamplingError, match="^TRL's vLLM importance-sampling correction compares"):
        check_comparable_sampling(temperature=1.0, top_p=0.9, reason="TRL's vLLM importance-sampling correction")


def test_plain_temperature_sampling_is_accepted():
    check_comparable_sampling(temperature=0.7, top_k=-1, min_p=None, generation_kwargs={"seed": 1, "ignore_eos": True})
    check_comparable_sampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                              generation_kwargs={"logit_bias": {}, "stop": ["\n\n"]})


@pytest.mark.parametrize(
    "key,field",
    [("temperature", "temperature"), ("top_p", "top_p"), ("max_tokens", "max_completion_length"),
     ("n", "num_generations"), ("repetition_penalty", "repetition_penalty")],
)
def test_generation_kwargs_never_override_a_config_field(key, field):
    """TRL applies generation_kwargs last: vLLM would sample with one value while the learner used the field's."""
    with pytest.raises(IncomparableSamplingError, match=f"'{key}' \\(set `{field}` instead\\)"):
        check_generation_kwargs({key: 0.5})


@pytest.mark.parametrize("key", ["logprobs", "prompt_logprobs"])
def test_generation_kwargs_cannot_change_the_returned_log_probs(key):
    """logprobs=5 made vLLM return the top-ranked token's log-prob instead of the sampled one's (gap_mean -0.64)."""
    with pytest.raises(IncomparableSamplingError, match=f"'{key}'.*sampled token's own log-prob"):
        check_generation_kwargs({key: 5})


def test_harmless_generation_kwargs_pass():
    check_generation_kwargs({"seed": 3, "stop": ["\n"], "ignore_eos": False, "skip_special_tokens": True})
    check_generation_kwargs(None)
