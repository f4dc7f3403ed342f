"""What one GRPO step could cost on this machine: its GEMM FLOPs and weight reads at the throughput this machine
measures on the model's own shapes, phase by phase (``bench_step.py`` prints measured / floor beside it).

The floor of a phase counts only the work it cannot avoid, at the machine's measured rates:

* a learner forward of ``n`` tokens of which ``s`` are scored (the completion tokens): ``2 x (decoder linear
  parameters x n + lm_head parameters x s)`` FLOPs (the vocabulary projection of a prompt position is thrown away,
  and the trainer no longer computes it on CPU; attention scores, norms and the log-softmax are left out, so the
  floor is low) at the measured GEMM throughput;
* a backward: the input gradients (one forward's FLOPs) plus the weight gradients of the trainable share (one
  forward's FLOPs times ``trainable / total`` linear parameters: ~0 for LoRA, 1 for full fine-tuning);
* generation: the prompts' prefill as a forward, then per decoding step the larger of reading every weight once
  (engine bytes / copy bandwidth) and the batch's GEMM FLOPs;
* sync: reading the master weights and writing the engine's copy once (2 x parameter bytes / copy bandwidth);
* optimizer: reading and writing the trainable parameters, their gradients and AdamW's two moments
  (8 x trainable bytes / copy bandwidth).

Rates: float32 GEMMs (and bf16 where the CPU has AVX512-BF16 or AMX) timed on each distinct linear shape of the
model at 2048 tokens (about one demo batch), weighted by how often the shape occurs; copy bandwidth from a 256 MiB
``Tensor.copy_`` (bytes read + written per second). They are measured once per process, before the first arm
trains, and shared by every arm, so the arms' floors compare alike even when other jobs load the machine later.
"""

from __future__ import annotations

import time
from collections import Counter

import torch


def _best_seconds(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def linear_shapes(model: torch.nn.Module) -> Counter:
    """``Counter({(in_features, out_features): count})`` of the model's ``nn.Linear`` layers but PEFT's LoRA A/B
    (their GEMMs are rank-thin), ``lm_head`` included even when tied."""
    shapes = Counter()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
            shapes[(module.in_features, module.out_features)] += 1
    return shapes


def gemm_throughput(shapes: Counter, tokens: int, dtype: torch.dtype) -> float:
    """FLOP/s of ``[tokens, in] @ [in, out]`` GEMMs in ``dtype``, over ``shapes`` weighted by their counts."""
    flops = seconds = 0.0
    for (k, n), count in shapes.items():
        x, w = torch.randn(tokens, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        seconds += count * _best_seconds(lambda: torch.nn.functional.linear(x, w))
        flops += count * 2.0 * tokens * k * n
    return flops / seconds


def copy_bandwidth(mib: int = 256) -> float:
    """Bytes per second of ``dst.copy_(src)`` on ``mib`` MiB (read + write counted)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / _best_seconds(lambda: dst.copy_(src))


_RATES: dict = {}


def machine_rates(shapes: Counter, tokens: int = 2048) -> tuple[float, float, float | None]:
    """``(fp32 FLOP/s, copy bytes/s, bf16 FLOP/s or None)`` on ``shapes``, measured at the first call and reused."""
    key = tuple(sorted(shapes.items()))
    if key not in _RATES:
        from triage_trl.runtime import native_bf16_gemm

        bf16 = gemm_throughput(shapes, tokens, torch.bfloat16) if native_bf16_gemm("cpu") else None
        _RATES[key] = (gemm_throughput(shapes, tokens, torch.float32), copy_bandwidth(), bf16)
    return _RATES[key]


class StepFloor:
    """The floor of each phase of a step of ``model``, from this machine's measured rates.

    Args:
        model: the learner (after the trainer built it: PEFT-wrapped, NVFP4-converted).
        engine_bytes_per_param: bytes per weight the sampler reads when decoding (4 for a float32 engine, 2 bf16).
        dtype: the learner's GEMM dtype.
    """

    def __init__(self, model: torch.nn.Module, engine_bytes_per_param: int):
        self.base_shapes = linear_shapes(model)
        self.linear_params = sum(k * n * c for (k, n), c in self.base_shapes.items())
        head = model.get_output_embeddings()
        self.head_params = head.in_features * head.out_features if isinstance(head, torch.nn.Linear) else 0
        params = list(model.parameters())
        self.param_bytes = sum(p.numel() * p.element_size() for p in params)
        self.trainable_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        self.trainable_share = min(1.0, trainable / self.linear_params)
        self.engine_bytes = self.linear_params * engine_bytes_per_param
        self.flops_per_s, self.bytes_per_s, self.bf16_flops_per_s = machine_rates(self.base_shapes)

    def forward(self, tokens: int, scored: int | None = None) -> float:
        """A learner forward of ``tokens`` positions, ``scored`` of them through the ``lm_head`` (default: all)."""
        scored = tokens if scored is None else scored
        return 2.0 * ((self.linear_params - self.head_params) * tokens + self.head_params * scored) / self.flops_per_s

    def backward(self, tokens: int, scored: int | None = None) -> float:
        return self.forward(tokens, scored) * (1.0 + self.trainable_share)

    def generation(self, prompt_tokens: int, sequences: int, new_tokens: int) -> float:
        decode_step = max(self.engine_bytes / self.bytes_per_s, 2.0 * self.linear_params * sequences / self.flops_per_s)
        return self.forward(prompt_tokens) + new_tokens * decode_step

    def sync(self) -> float:
        return 2.0 * self.param_bytes / self.bytes_per_s

    def optimizer(self) -> float:
        return 8.0 * self.trainable_bytes / self.bytes_per_s

    def rates(self) -> str:
        bf16 = f", bf16 GEMM {self.bf16_flops_per_s / 1e9:.1f} GFLOP/s" if self.bf16_flops_per_s else ""
        return (f"fp32 GEMM {self.flops_per_s / 1e9:.1f} GFLOP/s{bf16} on the model's shapes, copy "
                f"{self.bytes_per_s / 1e9:.1f} GB/s; {self.linear_params / 1e6:.1f}M linear parameters, trainable "
                f"share {self.trainable_share:.3f}")
