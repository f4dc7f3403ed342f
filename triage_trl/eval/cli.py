"""``triage-eval``: evaluate a model on GSM8K and the math benchmarks (greedy pass@1, avg@n, pass@k).

Example::

    triage-eval --model smollm2-135m-instruct --benchmarks gsm8k,math500 --data-dir data \\
        --limit 100 --precision nvfp4 --output-dir eval-smollm2-nvfp4

Writes ``results.json`` / ``results.md`` and per-problem records into ``--output-dir`` (rerunning the
same command resumes) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..nvfp4.config import PRECISIONS
from .benchmarks import BENCHMARKS

DEFAULT_BENCHMARKS = ",".join(BENCHMARKS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="triage-eval",
        description="Score a model on math benchmarks with math-verify: greedy pass@1, or avg@n and unbiased "
        "pass@k with --n > 1. bf16 or NVFP4 (the sampler's compressed-tensors export).",
    )
    p.add_argument("--model", required=True, help="model folder, Hub id, smollm2-135m-instruct (embedded default) "
                   "or tiny-qwen3 (a tiny offline model), as triage-grpo's --model_name_or_path")
    p.add_argument("--benchmarks", default=DEFAULT_BENCHMARKS, help=f"comma-separated, from: {DEFAULT_BENCHMARKS}")
    p.add_argument("--data-dir", default=None,
                   help="folder holding <benchmark>/test.jsonl files (e.g. data/gsm8k/test.jsonl); omit to load the "
                   "Hub datasets")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--backend", choices=("vllm", "transformers"), default="vllm")
    p.add_argument("--n", type=int, default=1, help="completions per problem (> 1 needs --temperature > 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="triage-eval-output", help="results and resume state (default: %(default)s)")
    p.add_argument("--no-one-shot", dest="one_shot", action="store_false",
                   help="drop the worked example turn (SmolLM2-135M needs it to write \\boxed{})")
    p.add_argument("--batch-size", type=int, default=16, help="transformers backend batch size")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM context (default: longest prompt + max new tokens)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--to-card", metavar="RUN_DIR", default=None,
                   help="also put the results into the model card of this training run (RUN_DIR/README.md): a "
                   "model-index the Hub reads and an Evaluation table")
    p.add_argument("--version", action="version", version=f"triage-trl {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``triage-eval`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    from .runner import evaluate

    if args.to_card is not None and not os.path.isfile(os.path.join(args.to_card, "README.md")):
        print(f"triage-eval: error: --to-card {args.to_card} holds no README.md: give the output_dir of a training "
              "run (the trainer writes its card there).", file=sys.stderr)
        return 2
    try:
        results = evaluate(
            args.model, args.benchmarks, data_dir=args.data_dir, precision=args.precision, backend=args.backend,
            n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens, limit=args.limit,
            seed=args.seed, output_dir=args.output_dir, one_shot=args.one_shot, batch_size=args.batch_size,
            max_model_len=args.max_model_len, progress=args.progress,
        )
    except (ValueError, FileNotFoundError, ConnectionError) as e:  # bad input, or a Hub benchmark offline
        print(f"triage-eval: error: {e}", file=sys.stderr)
        return 2
    print(results.to_markdown())
    results_json = os.path.join(args.output_dir, "results.json")
    print(f"results: {results_json}")
    if args.to_card is not None:
        from .card import add_eval_results_to_card

        add_eval_results_to_card(args.to_card, results_json)
        print(f"card: {os.path.join(args.to_card, 'README.md')} (model-index and Evaluation table)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
