"""Greedy agreement of a run's two engines: the vLLM sampler and the learner (transformers), same weights and scales.

For each precision setting, one trainer is built with the demo's config (``triage_trl.runs.build_config``; the
embedded SmolLM2-135M-Instruct, reasoning-gym held-out items) in its own process, the sampler is synced, and both
engines answer the same held-out prompts greedily (32 tokens): the vLLM sampler through
``triage_trl.eval.held_out.greedy_accuracy``, the learner through ``generate`` (left-padded batches). Prints per
setting the number of identical completions (text) and each engine's accuracy, and one line per setting
``agreement_<setting>=<identical / items>``.

Settings: ``bf16`` (bf16 sampler, float32 learner), and ``nvfp4_<recipe>`` (NVFP4 sampler and learner with the
learner mirroring the sampler's scales; recipes of ``docs/nvfp4.md``).

    python benchmarks/bench_engine_agreement.py [--items 128] [--settings bf16 nvfp4_paper nvfp4_all]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MAX_TOKENS = 32


def _overrides(setting: str) -> dict:
    if setting == "bf16":
        return {"learner_precision": "bf16", "sampler_precision": "bf16", "triage_mode": "diagnose"}
    if setting.startswith("nvfp4_"):
        return {"nvfp4_recipe": setting.removeprefix("nvfp4_")}
    raise SystemExit(f"Unknown setting {setting!r}: use bf16 or nvfp4_<recipe> (all, no_qkv, paper).")


def measure(setting: str, items: int, work_dir: str) -> dict:
    """Build one trainer, sync, answer ``items`` held-out prompts greedily with both engines; return the counts."""
    import torch

    from triage_trl.data import HELD_OUT_SEED, reasoning_gym_dataset
    from triage_trl.eval.held_out import greedy_accuracy
    from triage_trl.rewards import verified_answer_reward
    from triage_trl.runs import build_config, demo_rewards, resolve_model
    from triage_trl.runtime import vllm_process_settings
    from triage_trl.trainer import TriageGRPOTrainer

    held_out = reasoning_gym_dataset(size=items, seed=HELD_OUT_SEED)
    with vllm_process_settings():
        config = build_config(work_dir, max_steps=1, prompts_per_step=1, num_generations=2,
                              max_completion_length=MAX_TOKENS, temperature=0.7, learning_rate=1e-6,
                              **_overrides(setting))
        trainer = TriageGRPOTrainer(model=resolve_model(None, work_dir), reward_funcs=demo_rewards(), args=config,
                                    train_dataset=held_out)
        trainer.sync_sampler()
        sampler = greedy_accuracy(trainer, held_out, MAX_TOKENS)
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model).eval()
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in held_out["prompt"]]
        tokenizer.padding_side = "left"
        learner = []
        with torch.no_grad():
            for start in range(0, len(texts), 32):
                batch = tokenizer(texts[start:start + 32], return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**batch, do_sample=False, max_new_tokens=MAX_TOKENS,
                                     pad_token_id=tokenizer.pad_token_id)
                learner += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    learner_correct = verified_answer_reward(learner, held_out["answer"], held_out["answer_kind"],
                                             rg_entry=held_out["rg_entry"])
    identical = sum(a.strip() == b.strip() for a, b in zip(sampler.completions, learner, strict=True))
    return {"setting": setting, "items": items, "identical": identical, "sampler_correct": sampler.correct,
            "learner_correct": int(sum(learner_correct))}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=128)
    parser.add_argument("--settings", nargs="+", default=["bf16", "nvfp4_paper", "nvfp4_all"])
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # worker: one setting, JSON to --out
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as work:
            result = measure(args.one, args.items, work)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return [result]
    for setting in args.settings:
        _overrides(setting)
    from triage_trl.runtime import child_process_env

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings:  # one process per engine pair: vLLM's state is per process
            out = os.path.join(tmp, f"{setting}.json")
            subprocess.run([sys.executable, __file__, "--one", setting, "--items", str(args.items), "--out", out],
                           check=True, env=child_process_env())
            with open(out, encoding="utf-8") as f:
                results.append(json.load(f))
    print(f"\n{'setting':<14} {'identical greedy texts':>24} {'sampler acc.':>13} {'learner acc.':>13}")
    for r in results:
        n = r["items"]
        print(f"{r['setting']:<14} {r['identical']:>16d} / {n:<5d} {r['sampler_correct'] / n:>12.1%} "
              f"{r['learner_correct'] / n:>12.1%}")
    for r in results:
        print(f"agreement_{r['setting']}={r['identical'] / r['items']:.3f}")
    return results


if __name__ == "__main__":
    main()
