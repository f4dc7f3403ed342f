"""Which sampling settings keep the sampler's log-probs comparable with the learner's: one rule, decided in the config.

TRL's learner scores ``log_softmax(logits / temperature)`` of the sampled tokens. The vLLM sampler returns the
log-probs of the distribution it really samples from (``logprobs_mode="processed_logprobs"``): after penalties,
top-k/top-p/min-p truncation, logit bias, bad words, min-tokens and structured-output masks. Any of those makes the
two differ by construction, which TRIAGE (and TRL's own importance-sampling correction) would read as
learner/sampler mismatch. TRL also applies ``generation_kwargs`` last, so a key there that TRL sets from one of its
own fields (``temperature``, ``logprobs``, ...) silently gives the sampler another value than the learner uses.

Source: vLLM 0.31 ``v1/sample/sampler.py`` (processed log-probs), TRL 1.16 ``VLLMGeneration.generate``.
"""

from __future__ import annotations

import math
from typing import Any

# SamplingParams fields that change the distribution vLLM samples from, with their neutral value.
_NEUTRAL_SAMPLING = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logit_bias": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "logits_processors": None,
    "structured_outputs": None,
}
_NEUTRAL_TOP_K = (0, -1, None)
# SamplingParams keys TRL sets itself from a config field (or needs at a fixed value): in `generation_kwargs` they
# would silently override it on the sampler's side only.
_SET_BY_TRL = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_completion_length",
    "n": "num_generations",
    "logprobs": None,
    "prompt_logprobs": None,
}


class IncomparableSamplingError(ValueError):
    """A sampling setting makes the sampler's log-probs differ from the learner's by construction."""


def check_generation_kwargs(generation_kwargs: dict | None) -> None:
    """Refuse ``generation_kwargs`` keys that TRL sets itself from a config field.

    Raises:
        IncomparableSamplingError: naming each key and the config field to use instead.
    """
    bad = []
    for key in sorted(generation_kwargs or {}):
        if key not in _SET_BY_TRL:
            continue
        field_name = _SET_BY_TRL[key]
        bad.append(
            f"{key!r} (set `{field_name}` instead)" if field_name else f"{key!r} (TRL needs the sampled token's own "
            "log-prob only; remove it)"
        )
    if bad:
        raise IncomparableSamplingError(
            "generation_kwargs holds " + ", ".join(bad) + ". TRL applies generation_kwargs last, so the sampler would "
            "use another value than the learner, whose log-probs use the config fields: one value must serve both."
        )


def check_comparable_sampling(
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int | None = 0,
    min_p: float | None = 0.0,
    repetition_penalty: float = 1.0,
    generation_kwargs: dict | None = None,
    structured_outputs_regex: str | None = None,
    reason: str = "TRIAGE",
) -> None:
    """Refuse sampling settings under which the sampler's log-probs are not comparable with the learner's.

    Args:
        temperature, top_p, top_k, min_p, repetition_penalty, structured_outputs_regex: TRL's config fields.
        generation_kwargs: TRL's ``generation_kwargs`` (vLLM ``SamplingParams`` fields).
        reason: what compares the two log-probs, named in the message (e.g. ``"TRIAGE"`` or
            ``"TRL's vLLM importance-sampling correction"``).

    Raises:
        IncomparableSamplingError: ``temperature`` not finite and > 0, or a penalty, truncation, bias, mask or
            min-tokens setting away from its neutral value; the message names each setting and its neutral value.
    """
    settings: dict[str, Any] = {
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        **(generation_kwargs or {}),
    }
    if structured_outputs_regex is not None:
        settings["structured_outputs"] = structured_outputs_regex
    if temperature is None or not math.isfinite(temperature) or not temperature > 0:
        raise IncomparableSamplingError(
            f"temperature={temperature!r}: {reason} needs a finite temperature > 0. With greedy decoding (0) vLLM "
            "returns unscaled log-probs while the learner divides its logits by the temperature. Use temperature > 0."
        )
    bad = []
    if settings.get("top_k") not in _NEUTRAL_TOP_K:
        bad.append(f"top_k={settings['top_k']!r} (use 0)")
    for key, neutral in _NEUTRAL_SAMPLING.items():
        value = settings.get(key, neutral)
        if value is None or value == neutral or (neutral is None and not value):
            continue
        bad.append(f"{key}={value!r} (use {neutral!r})")
    if bad:
        raise IncomparableSamplingError(
            f"{reason} compares the sampler's log-probs with the learner's, and these sampling settings make them "
            "differ by construction: " + ", ".join(bad) + ". vLLM reports log-probs after penalties, truncation and "
            "masks while the learner scores log_softmax(logits / temperature) only. Sample with temperature only, "
            "or turn off what compares them (triage_mode='off' and vllm_importance_sampling_correction=False)."
        )
