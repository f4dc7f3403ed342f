"""Chat prompts asking for the final answer in ``\\boxed{}``, with a one-shot example turn.

SmolLM2-135M-Instruct does not write ``\\boxed{}`` when only told to (0% in 8 settings); one worked example turn
(user: a small problem + the instruction; assistant: a short solution ending in ``\\boxed{..}``) brings boxed
answers to nearly 100% on arithmetic (measured on 40 reasoning-gym items, greedy). Every adapter in this
package builds its prompts here, so all tasks share the instruction.
"""

from __future__ import annotations

INSTRUCTION = "Put your final answer within \\boxed{}."
"""Appended to every question (and to the example's question)."""

# (question, worked answer) one-shot example turns, per task family.
ARITHMETIC_EXAMPLE = ("What is 23 + 9 - 4?", "23 + 9 = 32, and 32 - 4 = 28.\nThe final answer is \\boxed{28}.")
WORD_PROBLEM_EXAMPLE = (
    "Tom has 3 boxes with 4 apples in each box. He eats 2 apples. How many apples does he have left?",
    "Tom has 3 * 4 = 12 apples. After eating 2 he has 12 - 2 = 10 apples.\nThe final answer is \\boxed{10}.",
)
LATEX_EXAMPLE = (
    "Simplify $\\frac{6}{8}$.",
    "Divide numerator and denominator by 2: $\\frac{6}{8} = \\frac{3}{4}$.\nThe final answer is "
    "\\boxed{\\frac{3}{4}}.",
)


def boxed_chat_prompt(question: str, example: tuple[str, str] | None = ARITHMETIC_EXAMPLE) -> list[dict[str, str]]:
    """Chat messages (TRL's conversational ``prompt``) asking ``question`` with the answer in ``\\boxed{}``.

    Args:
        question: the task's question text (no instruction).
        example: ``(question, worked answer)`` of the one-shot turn, or ``None`` for no example.

    Returns:
        ``[user, assistant, user]`` messages (``[user]`` without an example); the model's chat template adds its
        system prompt and the generation prompt.

    Raises:
        ValueError: empty ``question``, or an example whose answer has no ``\\boxed{``.
    """
    if not question or not question.strip():
        raise ValueError("question is empty: every prompt needs a question.")
    messages = []
    if example is not None:
        q, a = example
        if "\\boxed{" not in a:
            raise ValueError(f"The example answer {a!r} must end in \\boxed{{...}}: it shows the model the format.")
        messages += [{"role": "user", "content": f"{q} {INSTRUCTION}"}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": f"{question.strip()} {INSTRUCTION}"})
    return messages
