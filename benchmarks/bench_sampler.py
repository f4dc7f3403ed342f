"""Sampler speed: the bf16 and the NVFP4 vLLM sampler side by side, on a SmolLM2-135M-shaped model.

Builds a random ``LlamaConfig`` model with SmolLM2-135M's shapes (hidden 576, intermediate 1536, 30 layers,
9 heads, 3 KV heads, vocab 49152; no download, token ids only), starts ``TriageVLLMGeneration`` with
``sampler_precision="bf16"`` and ``"nvfp4"`` (on CPU: ``FastCpuNvFp4LinearKernel``) in this process, and times
``generate`` of the same fixed prompts (32 sequences x 128 new tokens, ``ignore_eos``), alternating the two
engines for ``--rounds`` rounds after a warm-up round. Reports the median time per round.

``--with-emulation`` adds a third engine on vLLM's own ``EmulationNvFp4LinearKernel`` for reference (it is
30-50x slower on CPU, so it generates ``--emulation-tokens`` tokens per sequence and its time is scaled to 128).

The last line is ``nvfp4_sampler_over_bf16=<ratio>`` (goal: <= 1.5). On a shared CPU the timings are noisy:
other processes steal cores; the alternation and the median make the *ratio* robust, not the absolute times.

Usage: ``python benchmarks/bench_sampler.py [--rounds 3] [--with-emulation]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch


def build_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def start_sampler(model, tokenizer, precision: str, workdir: str, max_tokens: int, n_seqs: int):
    from accelerate import Accelerator

    from triage_trl.sampler.vllm_generation import TriageVLLMGeneration

    calibration = [
        "What is 3 + 4? Let me think step by step.",
        "The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9.",
    ]
    return TriageVLLMGeneration(
        model,
        Accelerator(cpu=not torch.cuda.is_available()),
        tokenizer,
        sampler_precision=precision,
        calibration_prompts=calibration,
        checkpoint_dir=os.path.join(workdir, f"sampler-{precision}"),
        max_model_length=512,
        max_num_seqs=n_seqs,
        max_completion_length=max_tokens,
        temperature=1.0,
        generation_kwargs={"ignore_eos": True, "detokenize": False, "seed": 0},
    )


def fixed_prompts(n: int, length: int = 32, vocab: int = 49152) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def time_generate(sampler, prompts) -> tuple[float, int]:
    start = time.perf_counter()
    _, completion_ids, _, _ = sampler.generate(prompts, None, 1)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(c) for c in completion_ids)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--with-emulation", action="store_true")
    parser.add_argument("--emulation-tokens", type=int, default=8)
    args = parser.parse_args()

    from triage_trl.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_model()
    prompts = fixed_prompts(args.seqs)
    workdir = tempfile.mkdtemp(prefix="bench-sampler-")

    samplers = {}
    t0 = time.perf_counter()
    samplers["bf16"] = start_sampler(model, tokenizer, "bf16", workdir, args.tokens, args.seqs)
    samplers["nvfp4"] = start_sampler(model, tokenizer, "nvfp4", workdir, args.tokens, args.seqs)
    print(f"started 2 samplers in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}")
    for name, s in samplers.items():
        print(f"  {name}: {s.kernel_report}")

    for name, s in samplers.items():  # warm-up (first-call compilation, caches)
        time_generate(s, prompts)

    times: dict[str, list[float]] = {name: [] for name in samplers}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, s in samplers.items():
            elapsed, n = time_generate(s, prompts)
            times[name].append(elapsed)
            tokens[name] = n

    rows = []
    for name in samplers:
        med = statistics.median(times[name])
        rows.append((name, med, tokens[name] / med, ", ".join(f"{t:.2f}" for t in times[name])))

    if args.with_emulation:
        from vllm.model_executor.kernels import linear as linear_kernels
        from vllm.platforms import PlatformEnum

        from triage_trl.sampler import cpu_kernel

        cpu_kernel.register_emulation_nvfp4_kernel()
        cpu = linear_kernels._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU]
        cpu.remove(cpu_kernel.FastCpuNvFp4LinearKernel)
        register_fast = cpu_kernel.register_fast_cpu_nvfp4_kernel
        cpu_kernel.register_fast_cpu_nvfp4_kernel = lambda: None  # the sampler registers it at start
        try:
            emu = start_sampler(model, tokenizer, "nvfp4", workdir + "/emu", args.emulation_tokens, args.seqs)
        finally:
            cpu_kernel.register_fast_cpu_nvfp4_kernel = register_fast
            cpu.insert(0, cpu_kernel.FastCpuNvFp4LinearKernel)
        print(f"  emulation: {emu.kernel_report}")
        if "EmulationNvFp4LinearKernel" not in emu.kernel_report["linear_kernels"]:
            raise RuntimeError(f"the reference engine does not run vLLM's emulation kernel: {emu.kernel_report}")
        time_generate(emu, prompts)
        elapsed, n = time_generate(emu, prompts)
        scaled = elapsed * args.tokens / args.emulation_tokens
        rows.append((f"nvfp4 (vLLM emulation, {args.emulation_tokens} tok, scaled)", scaled, n / elapsed, f"{elapsed:.2f}"))

    bf16 = statistics.median(times["bf16"])
    print(f"\n{args.seqs} sequences x {args.tokens} new tokens, SmolLM2-135M shapes, random weights "
          f"(median of {args.rounds} alternating rounds; shared CPU, timings noisy)")
    print(f"{'sampler':<44} {'s/round':>9} {'tok/s':>9} {'x bf16':>7}  rounds (s)")
    for name, med, tps, all_times in rows:
        print(f"{name:<44} {med:>9.2f} {tps:>9.1f} {med / bf16:>7.2f}  {all_times}")
    print(f"nvfp4_sampler_over_bf16={statistics.median(times['nvfp4']) / bf16:.3f}")


if __name__ == "__main__":
    main()
