"""The cost of one GRPO optimizer step, by phase, against this machine's floor: bf16 sampler and learner with TRL's
loss vs NVFP4 sampler and learner with TRIAGE full, on SmolLM2-135M-Instruct (CPU, one process, colocated vLLM).

Each arm trains ``--warmup + --steps`` steps of the real ``TriageGRPOTrainer`` with the demo's settings and batch
(``triage_trl.runs.build_config`` and ``DEMO_DEFAULTS``: 2 prompts x 8 completions of the demo's task, LoRA rank 16,
the ``paper`` NVFP4 recipe, beta 0.04, float32 master weights), on the same prompts (same seed) and with the same
lengths (``ignore_eos``: every completion is ``--max-completion-length`` tokens). The arms differ only
in ``learner_precision``/``sampler_precision`` (``bf16`` vs ``nvfp4``) and ``triage_mode`` (``off``: TRL's loss with
its own importance-sampling correction; ``full``: TRIAGE's weights). The warm-up steps (start-up, NVFP4 calibration,
``torch.compile``) are not timed; the figures are means over the timed steps, in seconds, each phase counted once
(exclusive of the phases it calls):

* ``generation``: the vLLM sampler's ``generate``;
* ``sync``: export of the learner's weights (re-quantised for NVFP4), ``reload_weights``, the sync probe's vLLM
  scoring;
* ``logprobs``: the learner's log-prob passes (TRL's rollout-time ``old_per_token_logps``, the sync probe's, the
  forward of the loss);
* ``objective``: ``compute_loss`` less its forward (TRIAGE's weights and TRL's loss);
* ``backward``, ``optimizer`` (``optimizer.step``), ``other`` (rewards, advantages, clipping, logging);
* ``step``: ``on_step_begin`` to ``on_step_end``.

Beside each phase, its floor on this machine (``step_floor.py``: the phase's GEMM FLOPs and weight reads at the
GEMM throughput and copy bandwidth measured here, in the same run, on the model's own shapes) and measured / floor.
Both engines compute in ``triage_trl.runtime.engine_dtype()`` (float32 on CPUs without bf16 instructions).

Last lines: ``step_over_floor=<NVFP4+TRIAGE step / its floor>`` and
``nvfp4_triage_step_over_bf16=<NVFP4+TRIAGE step time / bf16+TRL step time>``.

Usage: ``python benchmarks/bench_step.py [--model tiny-qwen3] [--steps 2] [--warmup 1] [--prompts 2]
[--generations 8] [--max-completion-length 32]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import TrainerCallback

from triage_trl.trainer.shared_prompt import positions_needed

from bench_sync import timed
from step_floor import StepFloor

ARMS = {
    "bf16_trl": dict(learner_precision="bf16", sampler_precision="bf16", triage_mode="off"),
    "nvfp4_triage": dict(learner_precision="nvfp4", sampler_precision="nvfp4", triage_mode="full"),
}
PHASES = ("generation", "sync", "logprobs", "objective", "backward", "optimizer")
FLOOR_PHASES = ("generation", "sync", "logprobs", "backward", "optimizer")


class StepClock(TrainerCallback):
    """Per optimizer step: wall time, and the exclusive time of each phase (wrapped methods, see the module doc)."""

    def __init__(self, trainer):
        self.calls: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.steps: list[dict[str, float]] = []
        self.work: list[dict[str, int]] = []  # per step: the token counts the floor is computed from
        self._nesting: list[float] = []
        self._tokens = {"logprobs": 0, "logprobs_scored": 0, "loss": 0, "loss_scored": 0, "prompt": 0,
                        "sequences": 0, "new": 0, "backward": 0, "backward_scored": 0}
        self._in_loss = False
        self._count_work(trainer)
        gen = trainer.vllm_generation
        for owner, name, phase in ((gen, "generate", "generation"), (gen, "sync_weights", "sync"),
                                   (trainer, "_get_per_token_logps_and_entropies", "logprobs"),
                                   (trainer, "compute_loss", "objective"), (trainer.accelerator, "backward", "backward")):
            self._wrap(owner, name, phase)

    def _count_work(self, trainer) -> None:
        """Record the tokens each timed call processes (wrapping the timed wrappers, outside them)."""
        counts, clock = self._tokens, self
        logps, loss, generate, backward = (trainer._get_per_token_logps_and_entropies, trainer.compute_loss,
                                           trainer.vllm_generation.generate, trainer.accelerator.backward)

        def logps_counted(model, input_ids, *args, **kwargs):
            keep = kwargs.get("logits_to_keep", args[1] if len(args) > 1 else input_ids.size(1))
            keep = min(int(keep), input_ids.size(1))
            scored = input_ids.size(0) * keep  # the positions the lm_head scores
            mask = kwargs.get("attention_mask", args[0] if args else torch.ones_like(input_ids))
            # the work needed: each distinct prompt once, then every completion (what the shared-prompt forward runs)
            needed = positions_needed(input_ids, mask, keep)
            counts["logprobs"] += needed
            counts["logprobs_scored"] += scored
            if clock._in_loss:
                counts["loss"] += needed
                counts["loss_scored"] += scored
            return logps(model, input_ids, *args, **kwargs)

        def loss_counted(*args, **kwargs):
            clock._in_loss = True
            try:
                return loss(*args, **kwargs)
            finally:
                clock._in_loss = False

        def generate_counted(prompts, images, num_generations, *args, **kwargs):
            out = generate(prompts, images, num_generations, *args, **kwargs)
            counts["prompt"] += sum(len(p) for p in prompts)
            counts["sequences"] += len(out[1])
            counts["new"] = max(counts["new"], max((len(c) for c in out[1]), default=0))
            return out

        def backward_counted(*args, **kwargs):
            counts["backward"] += counts["loss"]
            counts["backward_scored"] += counts["loss_scored"]
            counts["loss"] = counts["loss_scored"] = 0
            return backward(*args, **kwargs)

        trainer._get_per_token_logps_and_entropies = logps_counted
        trainer.compute_loss = loss_counted
        trainer.vllm_generation.generate = generate_counted
        trainer.accelerator.backward = backward_counted

    def _wrap(self, owner, name: str, phase: str) -> None:
        timed(owner, name, self.calls[phase], echo=False, nesting=self._nesting)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self._wrap(optimizer, "step", "optimizer")

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self._seen = {phase: len(calls) for phase, calls in self.calls.items()}
        self._tokens.update(dict.fromkeys(self._tokens, 0))

    def on_step_end(self, args, state, control, **kwargs):
        step = {phase: sum(calls[self._seen[phase]:]) for phase, calls in self.calls.items()}
        step["step"] = time.perf_counter() - self._start
        step["other"] = step["step"] - sum(step[phase] for phase in PHASES)
        self.steps.append(step)
        self.work.append(dict(self._tokens))


def floors(floor: StepFloor, work: dict[str, int], syncs: int) -> dict[str, float]:
    """Seconds per phase at this machine's floor for one step's ``work`` (``StepClock.work``)."""
    return {
        "generation": floor.generation(work["prompt"], work["sequences"], work["new"]),
        "sync": syncs * floor.sync(),
        "logprobs": floor.forward(work["logprobs"], work["logprobs_scored"]),
        "backward": floor.backward(work["backward"], work["backward_scored"]),
        "optimizer": floor.optimizer(),
    }


def run_arm(arm: str, model: str | None, work_dir: str, args) -> tuple[dict[str, float], dict[str, float]]:
    """Mean seconds per phase over the timed steps of one arm, and the mean floor of each phase."""
    from triage_trl.data import CALIBRATION_SEED, TRAIN_SEED, reasoning_gym_dataset
    from triage_trl.runs import DEMO_DEFAULTS, build_config, demo_rewards, lora_config, resolve_model
    from triage_trl.runtime import vllm_process_settings
    from triage_trl.trainer import TriageGRPOTrainer

    from triage_trl.runtime import engine_dtype

    config = build_config(
        f"{work_dir}/{arm}", max_steps=args.warmup + args.steps, prompts_per_step=args.prompts,
        num_generations=args.generations, max_completion_length=args.max_completion_length,
        temperature=DEMO_DEFAULTS["temperature"], learning_rate=DEMO_DEFAULTS["learning_rate"],
        nvfp4_recipe=args.nvfp4_recipe, beta=DEMO_DEFAULTS["beta"],
        generation_kwargs={"ignore_eos": True}, **ARMS[arm],
    )
    size = 8 * args.prompts * (args.warmup + args.steps)
    train = reasoning_gym_dataset(size=size, seed=TRAIN_SEED)
    with vllm_process_settings(cpu_kv_cache_gib=1):
        trainer = TriageGRPOTrainer(model=resolve_model(model, work_dir), args=config, train_dataset=train,
                                    reward_funcs=demo_rewards(), peft_config=lora_config(args.lora_rank),
                                    calibration_dataset=reasoning_gym_dataset(size=size, seed=CALIBRATION_SEED))
        clock = StepClock(trainer)
        trainer.add_callback(clock)
        with trainer:
            floor = StepFloor(trainer.model, engine_bytes_per_param=engine_dtype().itemsize)  # rates: once, first arm
            trainer.train()
    print(f"{arm}: {floor.rates()}", flush=True)
    timed_steps, timed_work = clock.steps[args.warmup:], clock.work[args.warmup:]
    times = {key: statistics.mean(s[key] for s in timed_steps) for key in (*PHASES, "other", "step")}
    floor_steps = [floors(floor, w, syncs=1) for w in timed_work]
    phase_floors = {key: statistics.mean(f[key] for f in floor_steps) for key in FLOOR_PHASES}
    phase_floors["step"] = sum(phase_floors.values())
    return times, phase_floors


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="`tiny-qwen3`, a local folder, or unset: SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per arm (>= 1)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps per arm first; 0 times the first step too (start-up, calibration, compile)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=16, help="the demo's LoRA rank; 0: full fine-tuning")
    parser.add_argument("--nvfp4-recipe", default="paper",
                        help="the demo's `paper`; `all` for a model too small to keep boundary blocks (tiny-qwen3)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0.")

    results, floor = {}, {}
    with tempfile.TemporaryDirectory() as work_dir:
        for arm in ARMS:
            results[arm], floor[arm] = run_arm(arm, args.model, work_dir, args)
            for key, seconds in results[arm].items():
                print(f"{arm} {key}_s={seconds:.3f}", flush=True)
    from triage_trl.runtime import compute_dtype_reason

    print(f"\n{args.prompts} prompts x {args.generations} completions x {args.max_completion_length} tokens, "
          f"{args.steps} timed step(s) after {args.warmup} warm-up; compute dtype {compute_dtype_reason()}\n")
    print("| phase | bf16 + TRL (s) | floor | / floor | NVFP4 + TRIAGE (s) | floor | / floor | NVFP4 / bf16 |\n"
          "|---|---|---|---|---|---|---|---|")
    bf16, nvfp4 = results["bf16_trl"], results["nvfp4_triage"]
    for key in bf16:
        cells = []
        for arm in ARMS:
            f = floor[arm].get(key)
            cells += [f"{results[arm][key]:.3f}", f"{f:.3f}" if f else "-",
                      f"{results[arm][key] / f:.2f}" if f else "-"]
        ratio = nvfp4[key] / bf16[key] if bf16[key] > 0 else float("nan")
        print(f"| {key} | {' | '.join(cells)} | {ratio:.2f} |")
    ratio = nvfp4["step"] / bf16["step"]
    print(f"step_over_floor={nvfp4['step'] / floor['nvfp4_triage']['step']:.3f}")
    print(f"nvfp4_triage_step_over_bf16={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
