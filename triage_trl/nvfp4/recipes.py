"""NVFP4 layer recipes: named presets of which decoder linears stay in bf16, applied by the one layer rule
(``triage_trl.nvfp4.selection``) to the learner and the sampler alike. The free-form settings
(``nvfp4_keep_first_blocks``, ``nvfp4_keep_last_blocks``, ``nvfp4_exclude_patterns``) apply on top.

* ``all``: every decoder linear whose shape allows it runs in NVFP4.
* ``no_qkv``: the attention input projections (q/k/v) stay in bf16; o_proj and the MLP run in NVFP4.
* ``paper``: what published NVFP4 reinforcement-learning setups keep in bf16: all of attention (q/k/v and its output
  projection), the first ``ceil(4%)`` and the last ``ceil(15%)`` of the decoder blocks; only the MLP (or MoE expert)
  linears of the middle blocks run in NVFP4. Sources and reasons: ``docs/nvfp4.md``.

Attention projections are recognised by their parent module's name (``self_attn``, ``attention``, ``attn``), so
fused layouts (``qkv_proj``, ``query_key_value``, ``Wqkv``) and MLA projections are covered too.
"""

from __future__ import annotations

import math
import re
from typing import Literal, get_args

__all__ = ["PAPER_FIRST_FRACTION", "PAPER_LAST_FRACTION", "RECIPES", "Recipe", "paper_kept_blocks", "recipe_keeps"]

Recipe = Literal["all", "no_qkv", "paper"]
RECIPES: tuple[str, ...] = get_args(Recipe)
PAPER_FIRST_FRACTION = 0.04  # verl's NVFP4 RL rollout keeps 2 of 48 blocks at the start
PAPER_LAST_FRACTION = 0.15  # NVIDIA's NVFP4 pretraining and NVFP4 RL recipes keep about the last 15% in bf16

_ATTENTION_PARENT = re.compile(r"(^|\.)\w*(attn|attention)\w*\.\w+$", re.IGNORECASE)
_ATTENTION_OUTPUT = frozenset({"o_proj", "out_proj", "dense", "Wo", "c_proj", "wo"})


def paper_kept_blocks(n_blocks: int) -> tuple[int, int]:
    """``(first, last)``: how many leading and trailing decoder blocks the ``paper`` recipe keeps in bf16."""
    return math.ceil(PAPER_FIRST_FRACTION * n_blocks), math.ceil(PAPER_LAST_FRACTION * n_blocks)


def recipe_keeps(recipe: str, name: str, block: int, n_blocks: int) -> str:
    """Why ``recipe`` keeps decoder linear ``name`` (Hugging Face module name) of block ``block`` (of ``n_blocks``)
    in bf16, or "" when the recipe quantises it.

    Raises:
        ValueError: unknown recipe.
    """
    if recipe not in RECIPES:
        raise ValueError(f"nvfp4_recipe={recipe!r} is invalid: it must be one of {', '.join(map(repr, RECIPES))}.")
    attention = bool(_ATTENTION_PARENT.search(name))
    output = name.rpartition(".")[2] in _ATTENTION_OUTPUT
    if recipe == "no_qkv" and attention and not output:
        return "attention q/k/v"
    if recipe == "paper":
        first, last = paper_kept_blocks(n_blocks)
        if attention:
            return "attention"
        if block < first:
            return f"one of the first {first} blocks"
        if block >= n_blocks - last:
            return f"one of the last {last} blocks"
    return ""
