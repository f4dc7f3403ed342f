"""The TRIAGE objective on one hand-made micro-batch: classify, diagnose, rebalance, repair.

Runs offline in a second (python examples/objective_walkthrough.py). Three completions of a math
answer; the learner and sampler disagree on some tokens, and the negative-advantage completion has a
line where amplifying tail tokens (A < 0, gap < 0) cluster. The third completion comes from a group
whose rewards were all equal: TRL gives it a rounding-residue advantage (+2.98e-4), and the objective,
told so through `zero_signal`, leaves its weights at 1. See docs/objective.md.
"""

import torch

from triage_trl import TriageConfig, build_newline_table, segment_ids, triage_weights
from triage_trl.testing import build_tiny_tokenizer

tokenizer = build_tiny_tokenizer()
texts = [
    "First, 12 - 5 = 7.\nSo the answer is \\boxed{7}.",
    "First, 12 - 5 = 8.\nSo the answer is \\boxed{8}.",
    "First, 3 + 4 = 7.\nThe answer is \\boxed{7}.",
]
encoded = tokenizer(texts, padding=True, return_tensors="pt")
completion_ids, mask = encoded["input_ids"], encoded["attention_mask"].bool()
B, T = completion_ids.shape

# Learner log-probs at rollout time and the sampler's (nats). The second completion's first line is
# where the NVFP4 sampler over-estimates the tokens the learner is about to push down.
torch.manual_seed(0)
old_logps = -torch.rand(B, T)
sampler_logps = old_logps + 0.02 * torch.randn(B, T)
first_line = torch.arange(T) < 8
sampler_logps[1, first_line] = old_logps[1, first_line] + 0.6  # gap = learner - sampler = -0.6 < 0
sampler_logps[0, 3] = old_logps[0, 3] - 1.2  # one severe positive gap in the rewarded completion
sampler_logps[2, 2] = old_logps[2, 2] - 1.2  # the same gap in the zero-signal completion: not repaired
advantages = torch.tensor([1.0, -1.0, 2.98e-4])
zero_signal = torch.tensor([False, False, True])  # the trainer knows: that group's rewards were all equal

config = TriageConfig(triage_tail_quantile=0.7)
seg = segment_ids(completion_ids, mode="newline", max_tokens=config.triage_segment_max_tokens,
                  newline_table=build_newline_table(tokenizer))
result = triage_weights(old_logps, sampler_logps, advantages, mask, seg, config, zero_signal=zero_signal)

print("segment ids:\n", seg)
print("weights:\n", result.weights)
for name in ("tau", "frac_NA", "frac_PA", "tail_count_NA", "tail_count_PA", "hot_segment_frac",
             "tail_concentration", "beta", "rebalanced_frac", "repaired_frac", "weight_min", "weight_max", "k3_kl"):
    print(f"triage/{name:20s} {result.metrics[name]:.4f}")
