"""Evaluation prompts: the training prompts' chat format, with the benchmark's one-shot example turn.

The instruction ("Put your final answer within \\boxed{}.") and the worked example turns come from
``triage_trl.data.prompts``, so a model is evaluated with exactly the prompt format TRIAGE trains it
on. The one-shot turn is on by default: SmolLM2-135M-Instruct writes ``\\boxed{}`` only with it
(measured: 0% boxed answers in 8 settings without it). GSM8K gets the word-problem example, the LaTeX benchmarks
the LaTeX one.
"""

from __future__ import annotations

from ..data.prompts import LATEX_EXAMPLE, WORD_PROBLEM_EXAMPLE, boxed_chat_prompt
from .benchmarks import Problem

__all__ = ["build_messages", "render_prompt"]


def build_messages(problem: Problem, *, one_shot: bool = True) -> list[dict[str, str]]:
    """Chat messages for ``problem``: ``[user, assistant, user]`` with the example, ``[user]`` without."""
    example = (WORD_PROBLEM_EXAMPLE if problem.kind == "gsm8k" else LATEX_EXAMPLE) if one_shot else None
    return boxed_chat_prompt(problem.problem, example)


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text: the tokenizer's chat template with the generation prompt.

    Raises:
        ValueError: the tokenizer has no chat template (evaluate an instruct/chat model, or set one).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; evaluate a chat model or set tokenizer.chat_template.")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
