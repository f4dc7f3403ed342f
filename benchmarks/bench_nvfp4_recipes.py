"""NVFP4 layer recipes and "4 over 6" weight block scales on SmolLM2-135M: weight error and k3 against the float model.

For each recipe (``all``, ``no_qkv``, ``paper``) x "4 over 6" (off, on), the emulated NVFP4 learner as it mirrors the
sampler (static activation scales calibrated on a fixed set, power-of-two weight scales; fp32 GEMM by default, which
differs from the sampler's bf16 GEMM by one bf16 rounding of each output and runs 10x faster on CPUs without bf16
instructions) scores 128 fixed samples drawn from the float model at T=0.7 on held-out reasoning-gym prompts:

* ``w_rel_mse``: ``sum ||Q(W) - W||^2 / sum ||W||^2`` over the NVFP4 layers; ``nvfp4_share``: their share of the
  decoder linear weights;
* ``k3``: mean over completion tokens of ``exp(r) - 1 - r``, ``r = logp_nvfp4 - logp_float`` at T=0.7 (the k3
  estimator of KL(float || NVFP4) from float samples, nats/token), with its standard error over the 128 samples;
  for "4 over 6" on, the paired change against off (per-sample token means, same samples), ± its standard error.

Everything is seeded; the samples and scales are identical between the rows (``--samples-file`` keeps the float
samples between runs). Last line: ``four_over_six_k3_ratio=<k3 with / k3 without, recipe all>``.

    python benchmarks/bench_nvfp4_recipes.py [--samples 128] [--max-new-tokens 48] [--gemm fp32|bf16]
        [--samples-file runs/bench_nvfp4_recipes_samples.json]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from triage_trl.data.reasoning_gym import HELD_OUT_SEED, TRAIN_SEED, reasoning_gym_dataset
from triage_trl.models import resolve_model_path
from triage_trl.nvfp4.calibration import calibrate_input_global_scales
from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.learner import NVFP4EmulatedLinear, convert_to_nvfp4_learner, set_sampler_input_scales

TEMPERATURE = 0.7
RECIPES = ("all", "no_qkv", "paper")


def _prompt_texts(tokenizer, dataset) -> list[str]:
    return [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in dataset["prompt"]]


def _batch(seqs: list[list[int]], pad: int):
    """Left-padded ids, attention mask and position ids for a batch of token lists."""
    width = max(map(len, seqs))
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def sample(model, tokenizer, prompts, max_new_tokens, batch_size=32) -> list[list[int]]:
    """Completions (token lists, up to and including EOS) sampled at T=0.7 from ``model``, seeded per batch."""
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids, mask, _ = _batch(chunk, tokenizer.pad_token_id)
        torch.manual_seed(start)
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE, top_k=0,
                             top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        for row in gen[:, ids.shape[1]:].tolist():
            end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            out.append(row[:end])
    return out


@torch.no_grad()
def completion_logps(model, prompts, completions, pad, batch_size=16) -> list[torch.Tensor]:
    """Per-token log-probs (at T=0.7) of each completion given its prompt."""
    out = []
    for start in range(0, len(prompts), batch_size):
        seqs = [p + c for p, c in zip(prompts[start : start + batch_size], completions[start : start + batch_size])]
        ids, mask, pos = _batch(seqs, pad)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        logps = torch.log_softmax(logits[:, :-1] / TEMPERATURE, -1).gather(-1, ids[:, 1:, None])[..., 0]
        for row, c in zip(logps, completions[start : start + batch_size]):
            out.append(row[row.shape[0] - len(c):])
    return out


def nvfp4_learner(path, config, tokenizer, calibration):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    selection = convert_to_nvfp4_learner(model, config)
    set_sampler_input_scales(model, calibrate_input_global_scales(model, tokenizer, calibration))
    return model.eval(), selection


def weight_error(model) -> tuple[float, float]:
    """(relative MSE of the NVFP4 weights, their share of the decoder linear weights)."""
    err = norm = nvfp4 = total = 0.0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            w = module.weight.detach().float()
            total += w.numel()
            if isinstance(module, NVFP4EmulatedLinear):
                err += (module.fake_quantized_weight().float() - w).square().sum().item()
                norm += w.square().sum().item()
                nvfp4 += w.numel()
    return err / norm, nvfp4 / total


def k3_per_sample(logps, float_logps) -> tuple[float, torch.Tensor]:
    """(mean k3 per token over all tokens, per-sample token means of k3)."""
    r = torch.cat([a - b for a, b in zip(logps, float_logps)])
    per_sample = torch.stack([(torch.expm1(a - b) - (a - b)).mean() for a, b in zip(logps, float_logps)])
    return (torch.expm1(r) - r).mean().item(), per_sample


def _se(values: torch.Tensor) -> float:
    return values.std().item() / math.sqrt(len(values))


def float_samples(base, tok, prompts, max_new_tokens, path):
    """The float model's completions, read from ``path`` when it holds them for these prompts, else sampled."""
    import json
    import os

    if path and os.path.isfile(path):
        saved = json.loads(open(path).read())
        if saved["prompts"] == prompts and saved["max_new_tokens"] == max_new_tokens:
            return saved["completions"]
    completions = sample(base, tok, prompts, max_new_tokens)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"prompts": prompts, "max_new_tokens": max_new_tokens, "completions": completions}, f)
    return completions


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--calibration", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gemm", choices=("fp32", "bf16"), default="fp32", help="nvfp4_emulation_dtype")
    parser.add_argument("--samples-file", default=None, help="JSON file keeping the float samples between runs")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    path = resolve_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    texts = _prompt_texts(tok, reasoning_gym_dataset(size=args.samples, seed=HELD_OUT_SEED))
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    calibration = _prompt_texts(tok, reasoning_gym_dataset(size=args.calibration, seed=TRAIN_SEED))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    completions = float_samples(base, tok, prompts, args.max_new_tokens, args.samples_file)
    float_logps = completion_logps(base, prompts, completions, tok.pad_token_id)
    n_tokens = sum(map(len, completions))
    print(f"SmolLM2-135M-Instruct, {len(prompts)} float samples at T={TEMPERATURE} ({n_tokens} tokens), "
          f"{args.calibration} calibration prompts, {args.gemm} GEMM, threads={torch.get_num_threads()}", flush=True)
    print("| recipe | 4 over 6 | NVFP4 share of decoder weights | weight rel. MSE | k3 vs float (nats/token) "
          "| k3 change from 4 over 6 (paired) |")
    print("|---|---|---|---|---|---|")
    k3_all, off = {}, None
    for recipe in RECIPES:
        for four in (False, True):
            config = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4", nvfp4_recipe=recipe,
                                 nvfp4_four_over_six=four, nvfp4_emulation_dtype=args.gemm)
            model, _ = nvfp4_learner(path, config, tok, calibration)
            mse, share = weight_error(model)
            k3, per_sample = k3_per_sample(completion_logps(model, prompts, completions, tok.pad_token_id),
                                           float_logps)
            if recipe == "all":
                k3_all[four] = k3
            change = f"{(per_sample - off).mean().item():+.4f} ± {_se(per_sample - off):.4f}" if four else ""
            off = per_sample
            print(f"| {recipe} | {'on' if four else 'off'} | {share:.1%} | {mse:.4f} | {k3:.4f} ± {_se(per_sample):.4f} "
                  f"| {change} |", flush=True)
    print(f"wall time {time.time() - t0:.0f} s")
    ratio = k3_all[True] / k3_all[False]
    print(f"four_over_six_k3_ratio={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
