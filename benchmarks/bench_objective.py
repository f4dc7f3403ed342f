"""Cost of the TRIAGE objective per micro-batch: segment ids + weights + metrics.

Times `segment_ids` followed by `triage_weights` (what the trainer runs per micro-batch) at 64k, 256k,
1M and 4M completion tokens in both segment modes: warm-up, then the median of repeats. Inputs look
like a real NVFP4 batch: 2048-token rows with ragged lengths, a Qwen-sized vocabulary with 1% newline
tokens, learner-sampler gaps ~ N(0, 0.1) nats, a few -inf sampler log-probs (0.05% of tokens).

Prints a table, then `objective_ms_per_1M=<newline mode at 1M> linearity=<per-token cost at 4M / 256k>`.

`--baseline REV` also times the single-module objective `triage_trl/objective.py` of git revision REV
(e.g. the commit before the objective became a package), interleaved with the current code call by call
so both see the same machine load, and prints per size the median of the paired time ratios and the
ratio of the fastest runs (current / baseline), then the median paired ratio over all sizes.
`--zero-signal-frac F` flags that share of the rows as zero-signal groups (the trainer's `zero_signal`).

Usage: python benchmarks/bench_objective.py [--device cuda] [--repeats 7] [--baseline REV] [--sizes 1M,4M]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from triage_trl import TriageConfig, segment_ids, triage_weights

SIZES = {"64k": 1 << 16, "256k": 1 << 18, "1M": 1 << 20, "4M": 1 << 22}
ROW = 2048
VOCAB = 151_936
REPO = Path(__file__).resolve().parents[1]


def make_batch(n_tokens: int, device: str, zero_signal_frac: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B = n_tokens // ROW
    old = -torch.rand(B, ROW, generator=g) * 2
    sampler = old + torch.randn(B, ROW, generator=g) * 0.1
    sampler.view(-1)[torch.randint(0, B * ROW, (B,), generator=g)] = -float("inf")
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(ROW // 2, ROW + 1, (B,), generator=g)
    mask = torch.arange(ROW)[None, :] < lengths[:, None]
    ids = torch.randint(0, VOCAB, (B, ROW), generator=g)
    table = torch.rand(VOCAB, generator=g) < 0.01
    zero_signal = torch.rand(B, generator=g) < zero_signal_frac if zero_signal_frac > 0 else None
    moved = [t.to(device) for t in (old, sampler, adv, mask, ids, table)]
    return (*moved, None if zero_signal is None else zero_signal.to(device))


def load_baseline(rev: str):
    """`triage_weights` of the single-module `triage_trl/objective.py` at git revision `rev`."""
    source = subprocess.check_output(["git", "show", f"{rev}:triage_trl/objective.py"], cwd=REPO, text=True)
    module = types.ModuleType("triage_trl._baseline_objective")
    module.__package__ = "triage_trl"  # its relative import of the config resolves to the current one
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source, f"{rev}:triage_trl/objective.py", "exec"), module.__dict__)
    return module.triage_weights


def make_step(fn, batch, config: TriageConfig, with_zero_signal: bool):
    old, sampler, adv, mask, ids, table, zero_signal = batch

    def step():
        seg = segment_ids(
            ids, mode=config.triage_segment_mode, max_tokens=config.triage_segment_max_tokens, newline_table=table
        )
        kwargs = {"zero_signal": zero_signal} if with_zero_signal else {}
        fn(old, sampler, adv, mask, seg, config, **kwargs)  # returns Python floats: already synchronised

    return step


def time_interleaved(steps: list, repeats: int, device: str) -> list[list[float]]:
    """Times (ms) of each step per repeat, the steps run back to back within a repeat."""
    for step in steps:
        step()
        step()
    times = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            times[i].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--baseline", default=None, help="git revision whose triage_trl/objective.py to compare")
    parser.add_argument("--zero-signal-frac", type=float, default=0.0, help="share of rows flagged zero-signal")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {','.join(SIZES)}")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = {label: SIZES[label] for label in args.sizes.split(",")}
    baseline = load_baseline(args.baseline) if args.baseline else None

    print(f"device={args.device} torch_threads={torch.get_num_threads()} torch={torch.__version__}")
    header = f"{'tokens':>7} {'mode':>8} {'ms':>9} {'ms_per_1M':>10}"
    print(header + (f" {'baseline_ms':>11} {'ratio':>6} {'min_ratio':>9}" if baseline else ""))
    per_1m, ratios = {}, []
    for mode in ("newline", "fixed"):
        config = TriageConfig(triage_segment_mode=mode)
        for label, n in sizes.items():
            batch = make_batch(n, args.device, args.zero_signal_frac)
            steps = [make_step(triage_weights, batch, config, True)]
            if baseline:
                steps.append(make_step(baseline, batch, config, False))
            times = time_interleaved(steps, args.repeats, args.device)
            ms = statistics.median(times[0])
            per_1m[(mode, label)] = ms * (1 << 20) / n
            line = f"{label:>7} {mode:>8} {ms:9.2f} {per_1m[(mode, label)]:10.2f}"
            if baseline:
                ratio = statistics.median(new / old for new, old in zip(*times))
                ratios.append(ratio)
                line += f" {statistics.median(times[1]):11.2f} {ratio:6.3f} {min(times[0]) / min(times[1]):9.3f}"
            print(line)
    if ("newline", "1M") in per_1m and ("newline", "4M") in per_1m and ("newline", "256k") in per_1m:
        linearity = per_1m[("newline", "4M")] / per_1m[("newline", "256k")]
        print(f"objective_ms_per_1M={per_1m[('newline', '1M')]:.2f} linearity={linearity:.2f}")
    if baseline:
        print(f"median_ratio_vs_{args.baseline}={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
