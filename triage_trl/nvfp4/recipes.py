"""NVFP4 layer recipes: named presets of which decoder linears stay in bf16, applied by the one layer rule
(``triage_trl.nvfp4.selection``) to the learner and the sampler alike. The free-form settings
(``nvfp4_keep_first_blocks``, ``nvfp4_keep_last_blocks``, ``nvfp4_exclude_patterns``) apply on top.

* ``all``: every decoder linear whose shape allows it runs in NVFP4.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["RECIPES", "Recipe", "recipe_keeps"]

Recipe = Literal["all"]
RECIPES: tuple[str, ...] = get_args(Recipe)


def recipe_keeps(recipe: str, leaf: str, block: int, n_blocks: int) -> str:
    """Why ``recipe`` keeps decoder linear ``leaf`` (its last name part, e.g. ``q_proj``) of block ``block`` (of
    ``n_blocks``) in bf16, or "" when the recipe quantises it.

    Raises:
        ValueError: unknown recipe.
    """
    if recipe not in RECIPES:
        raise ValueError(f"nvfp4_recipe={recipe!r} is invalid: it must be one of {', '.join(map(repr, RECIPES))}.")
    return ""
