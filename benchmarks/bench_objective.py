"""Cost of the TRIAGE objective per micro-batch: segment ids + weights + metrics.

Times `segment_ids` followed by `triage_weights` (what the trainer runs per micro-batch) at 64k, 256k,
1M and 4M completion tokens in both segment modes: warm-up, then the median of repeats. Inputs look
like a real NVFP4 batch: 2048-token rows with ragged lengths, a Qwen-sized vocabulary with 1% newline
tokens, learner-sampler gaps ~ N(0, 0.1) nats, a few -inf sampler log-probs.

Prints a table, then `objective_ms_per_1M=<newline mode at 1M> linearity=<per-token cost at 4M / 256k>`.
Usage: python benchmarks/bench_objective.py [--device cuda] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from triage_trl import TriageConfig, segment_ids, triage_weights

SIZES = {"64k": 1 << 16, "256k": 1 << 18, "1M": 1 << 20, "4M": 1 << 22}
ROW = 2048
VOCAB = 151_936


def make_batch(n_tokens: int, device: str, seed: int = 0):
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
    return [t.to(device) for t in (old, sampler, adv, mask, ids, table)]


def time_one(batch, config: TriageConfig, repeats: int, device: str) -> float:
    old, sampler, adv, mask, ids, table = batch

    def step():
        seg = segment_ids(
            ids, mode=config.triage_segment_mode, max_tokens=config.triage_segment_max_tokens, newline_table=table
        )
        triage_weights(old, sampler, adv, mask, seg, config)  # returns Python floats: already synchronised

    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"device={args.device} torch_threads={torch.get_num_threads()} torch={torch.__version__}")
    print(f"{'tokens':>7} {'mode':>8} {'ms':>9} {'ms_per_1M':>10}")
    per_1m = {}
    for mode in ("newline", "fixed"):
        config = TriageConfig(triage_segment_mode=mode)
        for label, n in SIZES.items():
            ms = time_one(make_batch(n, args.device), config, args.repeats, args.device)
            per_1m[(mode, label)] = ms * (1 << 20) / n
            print(f"{label:>7} {mode:>8} {ms:9.2f} {per_1m[(mode, label)]:10.2f}")
    linearity = per_1m[("newline", "4M")] / per_1m[("newline", "256k")]
    print(f"objective_ms_per_1M={per_1m[('newline', '1M')]:.2f} linearity={linearity:.2f}")


if __name__ == "__main__":
    main()
