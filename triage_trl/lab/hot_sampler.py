"""E3's controlled mismatch (``docs/stability.md``, "E3"): the sampler samples hotter than the learner scores.

Lab only. The user-facing trainer refuses a sampler temperature that differs from the learner's
(``triage_trl.trainer.sampling_rules``): the two engines must compute the same policy. The lab bypasses that on
purpose, after the trainer is built, by setting the temperature TRL's ``VLLMGeneration`` samples with
(``trainer.vllm_generation.temperature``) before each optimizer step: vLLM returns the log-probs of the distribution
it sampled from (``logprobs_mode="processed_logprobs"``), the learner scores at the configuration's temperature, so
the learner-sampler gap is the temperature's alone (both engines bf16, no quantisation). The sampler's temperature
rises linearly from ``start`` x T at step 1 to ``end`` x T at the last step: a mismatch that grows, like the one
reported before mismatch collapses, without any quantisation. The sync probe is unaffected (it scores at
temperature 1 in both engines).
"""

from __future__ import annotations

from transformers import TrainerCallback


def ramp(step: int, max_steps: int, start: float, end: float) -> float:
    """The factor at 1-based optimizer ``step`` of ``max_steps``: ``start`` at step 1, ``end`` at the last, linear."""
    if max_steps <= 1:
        return end
    frac = min(max(step - 1, 0), max_steps - 1) / (max_steps - 1)
    return start + (end - start) * frac


class HotSampler(TrainerCallback):
    """Sets the sampler's temperature to ``ramp(step) x temperature`` before each optimizer step's rollout.

    Launch configurations: single process with colocated vLLM (the lab's); not server mode (the server keeps its own
    sampling parameters).

    Args:
        trainer: a ``TriageGRPOTrainer`` with ``use_vllm=True``.
        start, end: the factor at the first and the last step (>= 1: the sampler is never colder).

    Raises:
        ValueError: a factor < 1, or ``end < start``.
    """

    def __init__(self, trainer, start: float, end: float):
        if not 1.0 <= start <= end:
            raise ValueError(f"HotSampler needs 1 <= start <= end (got start={start}, end={end}).")
        self.trainer, self.start, self.end = trainer, start, end
        self.base = float(trainer.args.temperature)
        self.temperatures: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        temperature = self.base * ramp(state.global_step + 1, state.max_steps, self.start, self.end)
        self.trainer.vllm_generation.temperature = temperature
        self.temperatures.append(temperature)
