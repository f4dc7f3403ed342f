"""One-shot CUDA check for triage-trl, one command on a bare CUDA machine (torch, transformers, peft; the wheels to
bring are listed in docs/gpu.md). Run from the tree: ``PYTHONPATH=. python scripts/gpu_check.py [--dry-run]``.

1. runs the device-aware tests (``tests/test_device_paths.py``) with ``TRIAGE_TEST_DEVICE=cuda``: the emulated
   learner at odd sequence lengths, weight-cache invalidation, the objective against CPU (a skip is a failure here);
2. compares CUDA against CPU on the same random inputs: the TRIAGE objective (weights and metrics), the NVFP4
   quantiser (bit-exact) and the emulated W4A4 linear (float32, TF32 off, to a tolerance);
3. converts a tiny Qwen3 on the GPU with ``convert_to_nvfp4_learner(native="auto")`` and reports each layer's path
   (native on sm100 with torchao's recipe, emulated otherwise), then runs a forward+backward;
4. measures the learner's fwd+bwd and re-quantise cost at Qwen3-4B MLP shapes as ratios to bf16;
5. runs ``benchmarks/bench_nvfp4.py`` and ``benchmarks/bench_objective.py`` on CUDA.

Prints one table and exits non-zero on any failure; budget under 8 minutes. ``--dry-run`` (automatic without CUDA)
runs every step on CPU at toy sizes (tests with ``TRIAGE_TEST_DEVICE=cpu``), so the script itself is checked anywhere
in about a minute.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 8 * 60
ROWS: list[tuple[str, str, str, float]] = []


def record(check: str, ok: bool | None, detail: str, seconds: float) -> None:
    ROWS.append((check, {True: "ok", False: "FAIL", None: "skip"}[ok], detail, seconds))
    print(f"[{ROWS[-1][1]:4s}] {check}: {detail} ({seconds:.1f}s)", flush=True)


def step(check):
    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                ok, detail = fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - every failure becomes a FAIL row
                ok, detail = False, f"{type(err).__name__}: {err}"[:300]
            record(check, ok, detail, time.perf_counter() - t0)

        return run

    return wrap


def _run(cmd, timeout, env=None):
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout + proc.stderr


def _remaining(t_start):
    return BUDGET_S - (time.perf_counter() - t_start)


DEVICE_TESTS = ["tests/test_device_paths.py"]  # read TRIAGE_TEST_DEVICE through tests/conftest.py's test_device


@step("pytest on the device")
def check_pytest(device, t_start):
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *DEVICE_TESTS]
    rc, out = _run(cmd, timeout=max(30, min(300, _remaining(t_start) - 150)), env={"TRIAGE_TEST_DEVICE": device})
    last = [line for line in out.strip().splitlines() if line.strip()][-1:]
    skipped = "skipped" in (last[0] if last else "")
    return (rc == 0 and not skipped), f"TRIAGE_TEST_DEVICE={device}; {last[0] if last else 'no output'}"


def _time_ms(fn, device, repeats):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


@step("learner cost vs bf16 (Qwen3-4B MLP shapes)")
def check_learner_cost(device, dry):
    """fwd+bwd of one emulated NVFP4 linear (weights cached) and its re-quantise (cache invalidated, as after every
    optimizer step) as ratios to a bf16 nn.Linear; Qwen3-4B's up projection (2560 -> 9728) at 4096 tokens."""
    from torch import nn

    from triage_trl.nvfp4.learner import NVFP4EmulatedLinear, invalidate_nvfp4_weight_caches

    tokens, k, n, repeats = (128, 256, 512, 2) if dry else (4096, 2560, 9728, 10)
    torch.manual_seed(3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bf16 = nn.Linear(k, n, bias=False).to(device, dtype)
    nvfp4 = NVFP4EmulatedLinear.from_linear(nn.Linear(k, n, bias=False).to(device, dtype), name="up_proj")
    x = torch.randn(tokens, k, device=device, dtype=dtype, requires_grad=True)

    def fwd_bwd(layer):
        return lambda: layer(x).sum().backward()

    base = _time_ms(fwd_bwd(bf16), device, repeats)
    cached = _time_ms(fwd_bwd(nvfp4), device, repeats)
    requant = _time_ms(lambda: (invalidate_nvfp4_weight_caches(nvfp4), nvfp4.fake_quantized_weight()), device, repeats)
    shape = f"{tokens}x{k}x{n} {str(dtype).removeprefix('torch.')}"
    return True, (f"{shape}: fwd+bwd {cached / base:.2f}x bf16 ({base:.2f} ms); re-quantise {requant / base:.2f}x "
                  "bf16 fwd+bwd")


def _objective_inputs(B=8, T=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    sampler = old + torch.randn(B, T, generator=g) * 0.2
    sampler[0, 5] = -float("inf")
    adv = torch.randn(B, generator=g)
    mask = torch.arange(T)[None, :] < torch.randint(T // 2, T + 1, (B, 1), generator=g)
    seg = (torch.arange(T) // 16).expand(B, T).contiguous()
    return old, sampler, adv, mask, seg


@step("objective CUDA vs CPU")
def check_objective(device):
    from triage_trl import TriageConfig, triage_weights

    inputs = _objective_inputs()
    worst = 0.0
    for cfg in (TriageConfig(), TriageConfig(triage_tail_quantile=0.5, triage_hot_min_tokens=1, triage_hot_density=0.0)):
        cpu = triage_weights(*inputs, cfg)
        dev = triage_weights(*(t.to(device) for t in inputs), cfg)
        if dev.weights.device.type != torch.device(device).type:
            return False, f"weights came back on {dev.weights.device}"
        if not torch.allclose(dev.weights.cpu(), cpu.weights, rtol=1e-5, atol=1e-6):
            return False, f"weights differ, max |d| {(dev.weights.cpu() - cpu.weights).abs().max():.3g}"
        worst = max(worst, (dev.weights.cpu() - cpu.weights).abs().max().item())
        for k, v in cpu.metrics.items():
            w = dev.metrics.get(k)
            if w is None or not (math.isclose(v, w, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(v) and math.isnan(w))):
                return False, f"metric {k}: cpu {v} vs {device} {w}"
    return True, f"weights max |d| {worst:.2g}; {len(cpu.metrics)} metrics match"


@step("nvfp4 quantiser CUDA vs CPU")
def check_quantiser(device):
    from triage_trl.nvfp4.quantize import nvfp4_fake_quantize, nvfp4_fake_quantize_reference

    g = torch.Generator().manual_seed(1)
    n = 0
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        x = (torch.randn(512, 1024, generator=g) ** 3).to(dtype)
        cpu = nvfp4_fake_quantize(x)
        fast = nvfp4_fake_quantize(x.to(device))
        ref = nvfp4_fake_quantize_reference(x.to(device))
        if not torch.equal(fast.cpu().view(bits), cpu.view(bits)):
            return False, f"{dtype}: compiled path on {device} != CPU"
        if not torch.equal(fast.view(bits), ref.view(bits)):
            return False, f"{dtype}: compiled path != torchao on {device}"
        n += x.numel()
    return True, f"{n} elements bit-exact (compiled {device} == torchao {device} == CPU)"


@step("emulated W4A4 linear CUDA vs CPU")
def check_linear(device):
    from torch import nn

    from triage_trl.nvfp4.learner import NVFP4EmulatedLinear

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(2)
    lin = NVFP4EmulatedLinear.from_linear(nn.Linear(256, 128))
    x = torch.randn(4, 64, 256)
    y_cpu = lin(x)
    lin_dev = NVFP4EmulatedLinear.from_linear(nn.Linear(256, 128).to(device))
    lin_dev.load_state_dict(lin.state_dict())
    y_dev = lin_dev(x.to(device))
    err = (y_dev.cpu() - y_cpu).abs().max().item()
    return bool(torch.allclose(y_dev.cpu(), y_cpu, rtol=1e-4, atol=1e-4)), f"fp32 max |d| {err:.2g} (tol 1e-4)"


@step("learner paths (tiny Qwen3)")
def check_learner_paths(device):
    from transformers import AutoModelForCausalLM

    from triage_trl.nvfp4.learner import convert_to_nvfp4_learner, learner_execution_summary, native_nvfp4_available
    from triage_trl.testing import save_tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(save_tiny_qwen3(tmp), dtype=torch.bfloat16).to(device)
    print(convert_to_nvfp4_learner(model, native="auto"), flush=True)
    s = learner_execution_summary(model)
    native_ok, why = native_nvfp4_available(device) if torch.device(device).type == "cuda" else (False, "cpu")
    if native_ok and not s["nvfp4/native"]:
        return False, "sm100 GPU but no layer took the native path"
    ids = torch.randint(0, model.config.vocab_size, (1, 128), device=device)  # torchao native: M % 128 == 0
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    finite = bool(torch.isfinite(loss).item())
    return finite, f"native {s['nvfp4/native']}, emulated {s['nvfp4/emulated']}, bf16 {s['nvfp4/kept_bf16']}; loss {loss.item():.3f}" + (f"; native unavailable: {why}" if not native_ok else "")


@step("bench_nvfp4")
def check_bench_nvfp4(device, dry, t_start):
    cmd = [sys.executable, "benchmarks/bench_nvfp4.py", "--device", device]
    if dry:
        cmd += ["--tokens", "256", "--warmup", "1", "--repeats", "1", "--models", "SmolLM2-135M"]
    rc, out = _run(cmd, timeout=max(30, min(240, _remaining(t_start) - 60)))
    lines = [line for line in out.splitlines() if "ms |" in line or line.startswith("nvfp4_emulated_over_bf16=")]
    for line in lines:
        print("   ", line)
    return rc == 0 and bool(lines), lines[-1] if lines else out[-300:]


@step("bench_objective")
def check_bench_objective(device, dry, t_start):
    if dry:
        return None, "skipped in dry run (4M-token sizes)"
    rc, out = _run([sys.executable, "benchmarks/bench_objective.py", "--device", device, "--repeats", "3"],
                   timeout=max(30, min(180, _remaining(t_start) - 10)))
    last = [line for line in out.splitlines() if line.startswith("objective_ms_per_1M")]
    return rc == 0 and bool(last), last[-1] if last else out[-300:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU only, toy sizes, device tests on CPU")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda"
    t_start = time.perf_counter()
    if dry:
        print("dry run: no CUDA device or --dry-run; every check runs on CPU (comparisons are CPU vs CPU)")
    else:
        cap = torch.cuda.get_device_capability()
        print(f"device: {torch.cuda.get_device_name()} sm{cap[0]}{cap[1]}, torch {torch.__version__}")
    check_pytest(device, t_start)
    check_objective(device)
    check_quantiser(device)
    check_linear(device)
    check_learner_paths(device)
    check_learner_cost(device, dry)
    check_bench_nvfp4(device, dry, t_start)
    check_bench_objective(device, dry, t_start)
    total = time.perf_counter() - t_start
    width = max(len(r[0]) for r in ROWS)
    print("\n| " + "check".ljust(width) + " | result | seconds | detail")
    print("|-" + "-" * width + "-|--------|---------|-------")
    for check, res, detail, sec in ROWS:
        print(f"| {check.ljust(width)} | {res:6s} | {sec:7.1f} | {detail}")
    failed = [r for r in ROWS if r[1] == "FAIL"]
    over = total > BUDGET_S
    print(f"\ntotal {total:.0f}s (budget {BUDGET_S}s){' OVER BUDGET' if over else ''}; "
          f"{'FAILED: ' + ', '.join(r[0] for r in failed) if failed else 'all checks passed'}")
    return 1 if failed or over else 0


if __name__ == "__main__":
    sys.exit(main())
