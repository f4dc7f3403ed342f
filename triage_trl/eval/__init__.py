"""triage-eval: greedy pass@1, avg@n and unbiased pass@k on GSM8K and five math benchmarks, scored by math-verify.

Python API (notebooks)::

    from triage_trl.eval import evaluate
    res = evaluate("smollm2-135m-instruct", ["gsm8k", "math500"], data_dir="DATA_DIR", limit=50,
                   backend="vllm", precision="nvfp4", output_dir="eval-out")
    print(res.to_markdown()); res.benchmarks["gsm8k"].records[0]

Command line: ``triage-eval --model PATH --benchmarks gsm8k,math500 --data-dir DATA_DIR`` (see ``cli.py``;
``DATA_DIR/<benchmark>/test.jsonl``, ``docs/evaluation.md``).
"""

from .benchmarks import BENCHMARK_RECORDS, BENCHMARKS, HUB_SOURCES, Benchmark, Problem, load_benchmark
from .metrics import default_ks, pass_at_k, summarize
from .runner import BenchmarkResult, EvalConfig, EvalResults, evaluate, score_completions

__all__ = [
    "BENCHMARKS",
    "BENCHMARK_RECORDS",
    "HUB_SOURCES",
    "Benchmark",
    "BenchmarkResult",
    "EvalConfig",
    "EvalResults",
    "Problem",
    "default_ks",
    "evaluate",
    "load_benchmark",
    "pass_at_k",
    "score_completions",
    "summarize",
]
