"""The lab's fixed probe: the same prompts and completions re-scored by both engines every few optimizer steps.

The training batch's k3 (``triage/k3_kl``) is measured on fresh rollouts, so it mixes a change of the engines with a
change of what the policy writes. The fixed probe holds the text still: completions drawn once, at step 0, from the
run's own sampler at the training temperature, then re-scored by the learner (its own forward) and the sampler
(vLLM's prompt log-probs), both at temperature 1, after a weight sync. Its k3 (nats/token) moves only with the
engines' weights. Also used by E1 (``benchmarks/mechanism_e1.py``) to re-score a rollout batch.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from transformers import TrainerCallback

from .mechanism import mismatch_stats


@torch.no_grad()
def learner_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int, temperature: float,
                  rows: int = 4) -> torch.Tensor:
    """(B, keep) log-probs (nats) of the last ``keep`` tokens under the learner at ``temperature``: the model's own
    forward (TRL's fused head bakes in the sampling temperature), ``rows`` sequences at a time."""
    return learner_logps_at(model, input_ids, attention_mask, keep, (temperature,), rows)[0]


@torch.no_grad()
def learner_logps_at(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int,
                     temperatures: tuple[float, ...], rows: int = 4) -> torch.Tensor:
    """(len(temperatures), B, keep): :func:`learner_logps` at each temperature, from one forward."""
    out = []
    for start in range(0, input_ids.size(0), rows):
        ids, attention = input_ids[start:start + rows], attention_mask[start:start + rows]
        # logits_to_keep: the LM head runs only on the positions that predict the kept tokens
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=keep + 1).logits
        logits = logits[:, -keep - 1:-1].float()
        targets = ids[:, -keep:, None]
        out.append(torch.stack([torch.log_softmax(logits / t, dim=-1).gather(-1, targets).squeeze(-1)
                                for t in temperatures]))
    return torch.cat(out, dim=1)


def temperature_dose(model, batch: dict, temperature: float, factor: float) -> dict:
    """E3's dose on fixed text: the learner's log-probs of a batch's completion tokens at ``temperature`` (the
    learner's) against its own at ``factor x temperature`` (the hot sampler's), as
    :func:`triage_trl.lab.mechanism.mismatch_stats` of that pair: ``{"k3", "gap_mean", "p99_abs_gap"}`` (nats/token;
    p99 in nats): the temperature's share of the learner-sampler mismatch on the probe's tokens. At the hot doses
    neither engine quantises; their own agreement is the ``bf16`` arm's fixed-probe k3 (about 1e-10 on AVX2 CPUs,
    where both compute in float32; more where the sampler computes in bf16). The probe's tokens were sampled at
    ``temperature``, not at the hot one, so on them k3 measures the mismatch as the NVFP4 doses' fixed probe does
    (on fixed text, not on the hot sampler's own draws); those score at temperature 1, the same units when
    ``temperature`` is 1 (E2's and E3's preset).

    Args:
        batch: TRL's rollout layout (:func:`pad_batch`).
        factor: >= 1 (:func:`triage_trl.lab.hot_sampler.ramp`).
    """
    learner, hot = learner_logps_at(model, *_learner_inputs(batch), (temperature, factor * temperature))
    return _mismatch(learner, hot, batch)


def _learner_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, attention_mask, keep)`` of a rollout batch: prompt and completion joined, the completion's
    length kept (:func:`learner_logps_at`'s arguments)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention, batch["completion_ids"].size(1)


def _mismatch(learner: torch.Tensor, sampler: torch.Tensor, batch: dict) -> dict:
    """``{"k3", "gap_mean", "p99_abs_gap"}`` of two (B, T) log-prob tensors over the batch's completion tokens."""
    mask = batch["completion_mask"].bool()
    stats = mismatch_stats(learner, sampler, mask, {q: torch.zeros_like(mask) for q in ("NA", "PA", "NC", "PC")})
    return {k: stats[k] for k in ("k3", "gap_mean", "p99_abs_gap")}


@torch.no_grad()
def rescore(trainer, batch: dict, temperature: float,
            learner: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(learner, sampler) log-probs (B, T) of a batch's completions under the current weights at ``temperature``
    (the sampler must be synced); NaN at masked positions of the sampler's.

    Args:
        batch: TRL's rollout layout: ``prompt_ids``/``prompt_mask`` (B, P, left-padded), ``completion_ids``/
            ``completion_mask`` (B, T, right-padded).
        learner: the learner's log-probs at ``temperature`` when already computed (no second forward).
    """
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    if learner is None:
        learner = learner_logps(trainer.model, *_learner_inputs(batch), temperature)
    sequences, lengths = [], []
    for i in range(prompt_ids.size(0)):
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
        completion = completion_ids[i][completion_mask[i].bool()].tolist()
        sequences.append(prompt + completion)
        lengths.append(len(completion))
    scored = trainer.vllm_generation.score_logps(sequences, temperature=temperature)
    sampler = torch.full_like(learner, math.nan)
    for i, (values, n) in enumerate(zip(scored, lengths)):
        if n:
            sampler[i, :n] = torch.tensor(values[-n:], dtype=sampler.dtype)
    return learner.float(), sampler.float()


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int) -> dict:
    """TRL's rollout layout of token-id lists: prompts left-padded, completions right-padded (long tensors, masks
    0/1)."""
    b, p_len, c_len = len(prompts), max(map(len, prompts)), max(max(map(len, completions)), 1)
    batch = {"prompt_ids": torch.full((b, p_len), pad_token_id, dtype=torch.long),
             "prompt_mask": torch.zeros((b, p_len), dtype=torch.long),
             "completion_ids": torch.full((b, c_len), pad_token_id, dtype=torch.long),
             "completion_mask": torch.zeros((b, c_len), dtype=torch.long)}
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        batch["prompt_ids"][i, p_len - len(p):] = torch.tensor(p, dtype=torch.long)
        batch["prompt_mask"][i, p_len - len(p):] = 1
        if c:
            batch["completion_ids"][i, :len(c)] = torch.tensor(c, dtype=torch.long)
            batch["completion_mask"][i, :len(c)] = 1
    return batch


class FixedProbe(TrainerCallback):
    """k3 of the learner against the sampler on fixed completions, every ``every`` optimizer steps (and at the last).

    :meth:`capture` (step 0, after a sync) samples one completion per prompt of ``dataset`` from the sampler at
    ``temperature`` (vLLM seed ``seed``); :meth:`measure` syncs the sampler and re-scores them with both engines at
    temperature 1. Each record: ``{"step", "k3", "gap_mean", "p99_abs_gap", "tokens"}`` (nats/token; p99 in nats);
    with ``sampler_factor`` (E3's hot doses) also ``"dose_factor"`` and ``"dose_k3"`` (:func:`temperature_dose` at
    the factor the hot sampler sets for the next optimizer step: the dose calibrated on the probe's fixed text; with
    several updates per rollout the next rollout may come a step later, one ramp increment hotter).

    Launch configurations: single process with colocated vLLM (the lab's); not under DDP/FSDP2/ZeRO or server mode.

    Args:
        dataset: rows with a chat ``prompt`` (the first ``prompts`` are used).
        every: measure every this many optimizer steps.
        on_result: called with each record.
        sampler_factor: E3: ``step -> the factor`` by which the sampler's temperature exceeds the learner's for
            optimizer step ``step + 1`` (``hot_sampler.ramp``, as ``HotSampler`` sets it); ``None`` (no hot
            sampler): no dose fields.
    """

    def __init__(self, dataset, *, every: int, max_tokens: int, temperature: float, prompts: int = 16, seed: int = 0,
                 on_result: Callable | None = None, sampler_factor: Callable[[int], float] | None = None):
        if every < 1 or prompts < 1:
            raise ValueError(f"FixedProbe needs every >= 1 and prompts >= 1 (got every={every}, prompts={prompts}).")
        self.dataset = dataset.select(range(min(prompts, len(dataset))))
        self.every, self.max_tokens, self.temperature, self.seed = every, max_tokens, temperature, seed
        self.on_result, self.sampler_factor = on_result, sampler_factor
        self.trainer = None
        self.batch: dict | None = None
        self.records: list[dict] = []

    def capture(self, trainer) -> dict:
        """Sample the probe's completions from the (synced) sampler; returns the padded batch."""
        from vllm import SamplingParams

        self.trainer = trainer
        tokenizer = trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in self.dataset["prompt"]]
        params = SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, n=1, seed=self.seed)
        outputs = trainer.vllm_generation.llm.generate(texts, sampling_params=params, use_tqdm=False)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.batch = pad_batch([list(o.prompt_token_ids) for o in outputs],
                               [list(o.outputs[0].token_ids) for o in outputs], pad)
        return self.batch

    def measure(self, step: int) -> dict:
        """Sync the sampler, re-score the probe with both engines, record and return the step's numbers."""
        if self.batch is None:
            raise RuntimeError("FixedProbe.measure before capture: call capture(trainer) at step 0.")
        self.trainer.sync_sampler()
        was_training = self.trainer.model.training
        self.trainer.model.eval()
        try:
            dose, learner = {}, None
            if self.sampler_factor is not None:  # one forward for the engines' k3 (at 1) and the dose (T, factor x T)
                factor = float(self.sampler_factor(step))
                learner, cold, hot = learner_logps_at(self.trainer.model, *_learner_inputs(self.batch),
                                                      (1.0, self.temperature, factor * self.temperature))
                dose = {"dose_factor": factor, "dose_k3": _mismatch(cold, hot, self.batch)["k3"]}
            learner, sampler = rescore(self.trainer, self.batch, 1.0, learner)
        finally:
            self.trainer.model.train(was_training)
        record = {"step": step, **_mismatch(learner, sampler, self.batch),
                  "tokens": int(self.batch["completion_mask"].sum()), **dose}
        self.records.append(record)
        if self.on_result is not None:
            self.on_result(record)
        return record

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is not None and (state.global_step % self.every == 0 or state.global_step == state.max_steps):
            self.measure(state.global_step)
