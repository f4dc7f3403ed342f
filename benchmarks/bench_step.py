"""The cost of one GRPO optimizer step, by phase: bf16 sampler and learner with TRL's loss vs NVFP4 sampler and
learner with TRIAGE full, on SmolLM2-135M-Instruct (CPU, one process, colocated vLLM).

Each arm trains ``--warmup + --steps`` steps of the real ``TriageGRPOTrainer`` with the demo's CPU settings
(``triage_trl.demo.build_config``: reasoning-gym prompts, float32 master weights), on the same prompts (same seed) and
with the same lengths (``ignore_eos``: every completion is ``--max-completion-length`` tokens). The arms differ only
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

Last line: ``nvfp4_triage_step_over_bf16=<NVFP4+TRIAGE step time / bf16+TRL step time>``. On a CPU without native
bf16 GEMMs (AVX2 only) torch emulates bf16 products while the NVFP4 layers form them in float32, so the ratio there
says little about a CPU or GPU with native bf16 (docs/nvfp4.md, "Step cost").

Usage: ``python benchmarks/bench_step.py [--model tiny-qwen3] [--steps 1] [--warmup 1] [--prompts 2]
[--generations 4] [--max-completion-length 32]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from transformers import TrainerCallback

from bench_sync import timed

ARMS = {
    "bf16_trl": dict(learner_precision="bf16", sampler_precision="bf16", triage_mode="off"),
    "nvfp4_triage": dict(learner_precision="nvfp4", sampler_precision="nvfp4", triage_mode="full"),
}
PHASES = ("generation", "sync", "logprobs", "objective", "backward", "optimizer")


class StepClock(TrainerCallback):
    """Per optimizer step: wall time, and the exclusive time of each phase (wrapped methods, see the module doc)."""

    def __init__(self, trainer):
        self.calls: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.steps: list[dict[str, float]] = []
        self._nesting: list[float] = []
        gen = trainer.vllm_generation
        for owner, name, phase in ((gen, "generate", "generation"), (gen, "sync_weights", "sync"),
                                   (trainer, "_get_per_token_logps_and_entropies", "logprobs"),
                                   (trainer, "compute_loss", "objective"), (trainer.accelerator, "backward", "backward")):
            self._wrap(owner, name, phase)

    def _wrap(self, owner, name: str, phase: str) -> None:
        timed(owner, name, self.calls[phase], echo=False, nesting=self._nesting)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self._wrap(optimizer, "step", "optimizer")

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self._seen = {phase: len(calls) for phase, calls in self.calls.items()}

    def on_step_end(self, args, state, control, **kwargs):
        step = {phase: sum(calls[self._seen[phase]:]) for phase, calls in self.calls.items()}
        step["step"] = time.perf_counter() - self._start
        step["other"] = step["step"] - sum(step[phase] for phase in PHASES)
        self.steps.append(step)


def run_arm(arm: str, model: str | None, work_dir: str, args) -> dict[str, float]:
    """Mean seconds per phase over the timed steps of one arm."""
    from triage_trl.data import TRAIN_SEED, reasoning_gym_dataset
    from triage_trl.demo import build_config
    from triage_trl.rewards import format_reward, verified_answer_reward
    from triage_trl.runs import resolve_model
    from triage_trl.runtime import vllm_process_settings
    from triage_trl.trainer import TriageGRPOTrainer

    config = build_config(
        f"{work_dir}/{arm}", max_steps=args.warmup + args.steps, prompts_per_step=args.prompts,
        num_generations=args.generations, max_completion_length=args.max_completion_length, temperature=0.7,
        learning_rate=1e-5, generation_kwargs={"ignore_eos": True}, **ARMS[arm],
    )
    train = reasoning_gym_dataset(size=8 * args.prompts * (args.warmup + args.steps), seed=TRAIN_SEED)
    with vllm_process_settings(cpu_kv_cache_gib=1):
        trainer = TriageGRPOTrainer(model=resolve_model(model, work_dir), args=config, train_dataset=train,
                                    reward_funcs=[verified_answer_reward, format_reward])
        clock = StepClock(trainer)
        trainer.add_callback(clock)
        with trainer:
            trainer.train()
    timed_steps = clock.steps[args.warmup:]
    return {key: statistics.mean(s[key] for s in timed_steps) for key in (*PHASES, "other", "step")}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="`tiny-qwen3`, a local folder, or unset: SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per arm (>= 1)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps per arm first; 0 times the first step too (start-up, calibration, compile)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=32)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0.")

    results = {}
    with tempfile.TemporaryDirectory() as work_dir:
        for arm in ARMS:
            results[arm] = run_arm(arm, args.model, work_dir, args)
            for key, seconds in results[arm].items():
                print(f"{arm} {key}_s={seconds:.3f}", flush=True)
    print(f"\n{args.prompts} prompts x {args.generations} completions x {args.max_completion_length} tokens, "
          f"{args.steps} timed step(s) after {args.warmup} warm-up\n")
    print("| phase | bf16 + TRL (s) | NVFP4 + TRIAGE (s) | ratio |\n|---|---|---|---|")
    bf16, nvfp4 = results["bf16_trl"], results["nvfp4_triage"]
    for key in bf16:
        ratio = nvfp4[key] / bf16[key] if bf16[key] > 0 else float("nan")
        print(f"| {key} | {bf16[key]:.3f} | {nvfp4[key]:.3f} | {ratio:.2f} |")
    ratio = nvfp4["step"] / bf16["step"]
    print(f"nvfp4_triage_step_over_bf16={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
