"""Emulated NVFP4 W4A4 linear forward+backward against bf16, side by side in one run.

One decoder block's linears (q, k, v, o, gate, up, down) of SmolLM2-135M and Qwen3-4B shapes, 2048
tokens, bf16 compute. Each repeat times the bf16 block and the emulated NVFP4 block back to back
(interleaved, so machine load hits both alike); we report medians after warm-up.

"cached" is the training case this package is built for: the weights' fake-quantised copies are
reused until the next optimizer step (gradient accumulation / several micro-batches per step);
"requant" re-quantises every weight in every iteration (one optimizer step per micro-batch).

Last line: ``nvfp4_emulated_over_bf16=<ratio>`` (Qwen3-4B shapes, cached weights).

    python benchmarks/bench_nvfp4.py [--device cuda] [--repeats 5] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from triage_trl.nvfp4.learner import NVFP4EmulatedLinear

SHAPES = {
    # (in_features, out_features) of q, k, v, o, gate, up, down
    "SmolLM2-135M": [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)],
    "Qwen3-4B": [(2560, 4096), (2560, 1024), (2560, 1024), (4096, 2560), (2560, 9728), (2560, 9728), (9728, 2560)],
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _block_step(layers, inputs, grads, emulated, requant):
    for layer, x, g in zip(layers, inputs, grads):
        if emulated:
            if requant:
                layer.weight_generation.advance()
            y = layer(x)
        else:
            y = F.linear(x, layer.weight)
        y.backward(g)
        layer.weight.grad = None
        x.grad = None


def bench_model(name, shapes, tokens, device, dtype, warmup, repeats):
    gen = torch.Generator(device="cpu").manual_seed(0)
    layers, inputs, grads = [], [], []
    for in_f, out_f in shapes:
        lin = torch.nn.Linear(in_f, out_f, bias=False).to(device=device, dtype=dtype)
        layers.append(NVFP4EmulatedLinear.from_linear(lin))
        inputs.append(torch.randn(tokens, in_f, generator=gen).to(device=device, dtype=dtype).requires_grad_())
        grads.append(torch.randn(tokens, out_f, generator=gen).to(device=device, dtype=dtype))
    times = {"bf16": [], "cached": [], "requant": []}
    for i in range(warmup + repeats):
        for kind in times:
            _sync(device)
            t0 = time.perf_counter()
            _block_step(layers, inputs, grads, emulated=kind != "bf16", requant=kind == "requant")
            _sync(device)
            if i >= warmup:
                times[kind].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{name:14s} tokens={tokens} bf16 {med['bf16'] * 1e3:9.1f} ms | nvfp4 emulated cached "
        f"{med['cached'] * 1e3:9.1f} ms (x{med['cached'] / med['bf16']:.2f}) | requant every step "
        f"{med['requant'] * 1e3:9.1f} ms (x{med['requant'] / med['bf16']:.2f})",
        flush=True,
    )
    return med


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=list(SHAPES))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} (medians of {args.repeats} after {args.warmup} warm-up)")
    results = {m: bench_model(m, SHAPES[m], args.tokens, device, torch.bfloat16, args.warmup, args.repeats) for m in args.models}
    key = "Qwen3-4B" if "Qwen3-4B" in results else args.models[-1]
    ratio = results[key]["cached"] / results[key]["bf16"]
    print(f"nvfp4_emulated_over_bf16={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
