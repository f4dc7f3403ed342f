"""How much a GRPO run can learn on the demo's task: greedy accuracy against what sampling already finds, per prompt.

SmolLM2-135M-Instruct unquantised (plain vLLM in the sampler's dtype, the float model every NVFP4 recipe starts
from) answers the demo's 128 held-out reasoning-gym items (``chain_sum``, two 1-digit terms;
``triage_trl.data.reasoning_gym``) with each one-shot example turn:

* ``positive``: the former default example, ``23 + 9 = 32``;
* ``negative``: today's default (``RG_ARITHMETIC_EXAMPLE``), ``4 - 9 = -5``;
* ``none``: no example turn.

Per example it prints the greedy accuracy (32 tokens; the demo's held-out metric), split into additions, positive
subtractions and negative answers; the accuracy of 8 samples per item at T=0.7 (the demo's rollouts); ``pass@8``
(items with at least one correct sample: what GRPO can reinforce); and the items whose 8 samples have mixed rewards
(groups with a learning signal). Headroom is ``pass@8 - greedy``. Last lines: ``headroom_<example>=<points>``.

``--task chain_lines`` measures the stability lab's multi-line task instead (``CHAIN_LINES_TASK``, 4-5 terms worked
one partial sum per line; E2 in ``docs/stability.md``) with its own example, at ``--temperature`` (E2: 1.0) and
``--max-tokens`` (E2: 96); ``sometimes_<example>=`` is then the share of items whose samples are right sometimes
but not always (1 to samples-1 correct: the items E2 asks for).

    python benchmarks/bench_task_headroom.py [--items 128] [--samples 8] [--examples positive negative none]
    python benchmarks/bench_task_headroom.py --task chain_lines --temperature 1.0 --max-tokens 96
"""

from __future__ import annotations

import argparse
import re

MAX_TOKENS = 32
TEMPERATURE = 0.7
POSITIVE_EXAMPLE = (
    "State the final answer to the following arithmetic problem: 23 + 9 =",
    "23 + 9 = 32.\nThe final answer is \\boxed{32}.",
)


def _examples() -> dict:
    from triage_trl.data.reasoning_gym import CHAIN_LINES_EXAMPLE, RG_ARITHMETIC_EXAMPLE

    return {"positive": POSITIVE_EXAMPLE, "negative": RG_ARITHMETIC_EXAMPLE, "none": None, "lines": CHAIN_LINES_EXAMPLE}


def category(question: str, answer: str) -> str:
    """``"negative"`` (a negative answer), ``"subtraction"`` (a positive or zero difference) or ``"addition"``."""
    if answer.strip().startswith("-"):
        return "negative"
    return "subtraction" if re.search(r"\d\s*-\s*\d", question) else "addition"


def measure(llm, dataset, samples: int, temperature: float = TEMPERATURE, max_tokens: int = MAX_TOKENS) -> dict:
    """Greedy and sampled correctness of ``llm`` on ``dataset`` (a ``reasoning_gym_dataset``)."""
    from vllm import SamplingParams

    from triage_trl.rewards import verified_answer_reward

    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in dataset["prompt"]]
    greedy = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    sampled = llm.generate(texts, SamplingParams(temperature=temperature, max_tokens=max_tokens, n=samples),
                           use_tqdm=False)

    def score(completions, repeat):
        rows = lambda column: [v for v in dataset[column] for _ in range(repeat)]  # noqa: E731
        return verified_answer_reward(completions, rows("answer"), rows("answer_kind"), rg_entry=rows("rg_entry"))

    greedy_ok = score([o.outputs[0].text for o in greedy], 1)
    sample_ok = score([c.text for o in sampled for c in o.outputs], samples)
    per_item = [sum(sample_ok[i * samples:(i + 1) * samples]) / samples for i in range(len(texts))]
    categories = [category(p[-1]["content"], a) for p, a in zip(dataset["prompt"], dataset["answer"], strict=True)]
    by_category = {c: (int(sum(ok for ok, k in zip(greedy_ok, categories, strict=True) if k == c)),
                       categories.count(c)) for c in ("addition", "subtraction", "negative")}
    n = len(texts)
    return {"greedy": sum(greedy_ok) / n, "sampled": sum(sample_ok) / len(sample_ok),
            "pass_at_k": sum(p > 0 for p in per_item) / n, "mixed_groups": sum(0 < p < 1 for p in per_item),
            "by_category": by_category, "items": n,
            "completion_tokens": sum(len(c.token_ids) for o in sampled for c in o.outputs) / len(sample_ok),
            "lines": sum(c.text.count("\n") + 1 for o in sampled for c in o.outputs) / len(sample_ok)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--examples", nargs="+", default=None, choices=list(_examples()),
                        help="one-shot turns (default: positive negative none; chain_lines: lines)")
    parser.add_argument("--task", default="demo", choices=["demo", "chain_lines"])
    parser.add_argument("--temperature", type=float, default=TEMPERATURE)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--terms", type=int, default=None, help="terms per item (default: the task's)")
    parser.add_argument("--max-digits", type=int, default=None, help="largest operand digits (default: the task's)")
    args = parser.parse_args(argv)
    args.examples = args.examples or (["lines"] if args.task == "chain_lines" else ["positive", "negative", "none"])

    from vllm import LLM

    from triage_trl.data import HELD_OUT_SEED, reasoning_gym_dataset
    from triage_trl.data.reasoning_gym import CHAIN_LINES_TASK, DEFAULT_TASK
    from triage_trl.models import SMOLLM2, resolve_model_path
    from triage_trl.runtime import vllm_process_settings
    from triage_trl.sampler.vllm_engine import sampler_dtype

    results = {}
    with vllm_process_settings():
        # the dtype the project's sampler computes in here (float32 on CPUs without bf16 instructions)
        llm = LLM(model=resolve_model_path(SMOLLM2), dtype=sampler_dtype(), max_model_len=512, seed=0)
        for name in args.examples:
            task = dict(CHAIN_LINES_TASK if args.task == "chain_lines" else DEFAULT_TASK)
            if args.terms:
                task.update(min_terms=args.terms, max_terms=args.terms)
            if args.max_digits:
                task.update(max_digits=args.max_digits)
            dataset = reasoning_gym_dataset(task, size=args.items, seed=HELD_OUT_SEED, example=_examples()[name])
            results[name] = measure(llm, dataset, args.samples, args.temperature, args.max_tokens)
    k = args.samples
    print(f"\n{'example':<9} {'greedy':>7} {'add.':>7} {'pos. sub.':>9} {'negative':>8} {f'T={args.temperature:g}':>6} "
          f"{f'pass@{k}':>7} {'mixed groups':>12}")
    for name, r in results.items():
        cells = [f"{r['by_category'][c][0]}/{r['by_category'][c][1]}" for c in ("addition", "subtraction", "negative")]
        print(f"{name:<9} {r['greedy']:>7.1%} {cells[0]:>7} {cells[1]:>9} {cells[2]:>8} {r['sampled']:>6.1%} "
              f"{r['pass_at_k']:>7.1%} {r['mixed_groups']:>6d} / {r['items']:<4d}")
    for name, r in results.items():
        print(f"headroom_{name}={100 * (r['pass_at_k'] - r['greedy']):.1f}")
        print(f"sometimes_{name}={r['mixed_groups'] / r['items']:.3f} tokens_{name}={r['completion_tokens']:.1f} "
              f"lines_{name}={r['lines']:.2f}")
    return results


if __name__ == "__main__":
    main()
