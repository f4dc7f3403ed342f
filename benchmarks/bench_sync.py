"""The sampler sync (re-quantise + reload) and the sync probe as a share of one GRPO step, and the sync's peak extra
memory, on SmolLM2-135M-Instruct (CPU, one process, NVFP4 sampler + NVFP4 learner, TRIAGE full, the demo's settings
and batch: ``triage_trl.runs.build_config``, LoRA rank 16, 2 prompts x 8 completions of 32 tokens).

Trains ``--steps`` TRIAGE-GRPO steps with ``TriageGRPOTrainer`` (TRL syncs the sampler at the start of every step,
then the trainer runs the probe) and times, inside the same run, every sync (``_load_learner_weights``: calibration
if due, block-wise NVFP4 export, one ``reload_weights``) and every probe. The first step is a warm-up (it also
calibrates); the figures are medians over the later steps:

* ``sync_share=`` (sync + probe / ``sync_probe_every``) / (step time without a probe + probe / ``sync_probe_every``),
  from TRL's ``step_time`` (goal: <= 0.05): the probe runs after the first sync and every ``sync_probe_every``-th
  (the demo's setting unless ``--sync-probe-every``); ``sync_share_probe_every_sync=`` the same with a probe after
  every sync;
* ``sync_peak_share=`` the largest number of bytes the export had created and vLLM still held at one time (tensors
  with storage of their own: NVFP4 codes and scales, casts), over the learner's parameter bytes (goal: about one
  decoder layer, ``layer_share=``).

Usage: ``python benchmarks/bench_sync.py [--steps 3] [--model tiny-qwen3] [--lora-rank 16] [--nvfp4-recipe all]
[--sync-probe-every 1]`` (``--steps``: at least 2, and enough for two probes after the warm-up with the demo's
schedule: its default, ``1 + 2 * sync_probe_every``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
import weakref

import torch


class LiveBytes:
    """Bytes of the tensors an iterator created (own storage, not a model parameter's) that are still alive."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def track(self, pairs, model_storages: set[int]):
        for name, tensor in pairs:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in model_storages:
                size = storage.nbytes()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._free, size)
            yield name, tensor

    def _free(self, size: int):
        self.live -= size


def timed(owner, name: str, seconds: list[float], *, echo: bool = True, nesting: list[float] | None = None):
    """Wrap ``owner.<name>`` so each call appends its wall time to ``seconds`` (and prints it at once if ``echo``).

    ``nesting``: one list shared by several wrappers (initially empty); each call then records its exclusive time,
    less the time of the wrapped calls it made, so nested phases are not counted twice.
    """
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if nesting is not None:
            nesting.append(0.0)
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            inner = nesting.pop() if nesting is not None else 0.0
            if nesting:
                nesting[-1] += elapsed
            seconds.append(elapsed - inner)
            if echo:
                print(f"{name}_s={seconds[-1]:.3f}", flush=True)

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: 1 + 2 x the probe schedule")
    parser.add_argument("--model", default=None, help="`tiny-qwen3`, a local folder, or unset: SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=16, help="the demo's LoRA rank; 0: full fine-tuning")
    parser.add_argument("--nvfp4-recipe", default=None, help="default: the demo's (`paper`)")
    parser.add_argument("--sync-probe-every", type=int, default=None, help="default: the demo's")
    args = parser.parse_args(argv)

    from triage_trl.runs import DEMO_DEFAULTS

    every = DEMO_DEFAULTS["sync_probe_every"] if args.sync_probe_every is None else args.sync_probe_every
    if every < 1:
        parser.error(f"--sync-probe-every must be >= 1 (got {every}).")
    steps = args.steps if args.steps is not None else 1 + 2 * every
    if steps < 1 + every or steps < 2:
        parser.error(f"--steps must be >= {max(2, 1 + every)}: the first step is a warm-up (its sync is probed) and "
                     f"the next probe comes at step {1 + every} with --sync-probe-every {every}.")

    from triage_trl.data import CALIBRATION_SEED, TRAIN_SEED, reasoning_gym_dataset
    from triage_trl.runs import build_config, demo_rewards, lora_config, resolve_model
    from triage_trl.runtime import vllm_process_settings
    from triage_trl.trainer import TriageGRPOTrainer

    size = 8 * args.prompts * steps
    with tempfile.TemporaryDirectory() as out, vllm_process_settings(cpu_kv_cache_gib=1):
        config = build_config(
            out, max_steps=steps, prompts_per_step=args.prompts, num_generations=args.generations,
            max_completion_length=args.max_completion_length, temperature=DEMO_DEFAULTS["temperature"],
            learning_rate=DEMO_DEFAULTS["learning_rate"], beta=DEMO_DEFAULTS["beta"],
            nvfp4_recipe=args.nvfp4_recipe or DEMO_DEFAULTS["nvfp4_recipe"], generation_kwargs={"ignore_eos": True},
            sync_probe_every=every,
        )
        trainer = TriageGRPOTrainer(model=resolve_model(args.model, out), reward_funcs=demo_rewards(), args=config,
                                    train_dataset=reasoning_gym_dataset(size=size, seed=TRAIN_SEED),
                                    peft_config=lora_config(args.lora_rank),
                                    calibration_dataset=reasoning_gym_dataset(size=size, seed=CALIBRATION_SEED))
        gen = trainer.vllm_generation
        sync_s: list[float] = []
        probe_s: list[float] = []
        timed(gen, "_load_learner_weights", sync_s)
        timed(trainer, "_run_sync_probe", probe_s)
        live = LiveBytes()
        storages = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
        export = gen._iter_sampler_weights
        gen._iter_sampler_weights = lambda *args: live.track(export(*args), storages)
        with trainer:
            trainer.train()

        step_s = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
        param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        layers = [m for name, m in trainer.model.named_modules() if name.endswith("layers.0")]
        layer_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    # One sync and one step time per step, one probe per probed sync (the load at sampler start is not timed).
    # Step 1 warms up, and its sync is the first probed one. A probed step's time holds its probe: the step time
    # without a probe is the median over the unprobed steps (all of them when every sync is probed, less the probe).
    probed = {s + 1 for s in trainer.sync_probe_steps}  # 1-based steps whose sync was probed
    sync, probe = statistics.median(sync_s[1:]), statistics.median(probe_s[1:])
    unprobed = [t for i, t in enumerate(step_s, start=1) if i > 1 and i not in probed]
    bare = statistics.median(unprobed) if unprobed else statistics.median(step_s[1:]) - probe
    print(f"steps={len(step_s)} step_s_without_probe={bare:.3f} sync_s={sync:.3f} probe_s={probe:.3f} "
          f"probes={len(probe_s)} sync_probe_every={every}")
    print(f"param_bytes={param_bytes} sync_peak_extra_bytes={live.peak} layer_bytes={layer_bytes}")
    print(f"sync_peak_share={live.peak / param_bytes:.4f} layer_share={layer_bytes / param_bytes:.4f}")
    share = (sync + probe / every) / (bare + probe / every)
    print(f"sync_share_probe_every_sync={(sync + probe) / (bare + probe):.4f}")
    print(f"sync_share={share:.4f}")
    return share


if __name__ == "__main__":
    main()
