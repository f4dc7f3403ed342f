"""Response segments for TRIAGE's diagnosis (step 4 of ``docs/objective.md``).

A completion is cut into contiguous segments. ``newline`` mode ends a segment after every token
whose decoded text contains a newline and after ``max_tokens`` tokens since the segment began;
``fixed`` mode cuts windows of ``max_tokens`` tokens. Segment ids are computed on the device of
the inputs with cumulative sums and maxima: no Python loop over sequences or tokens.

Segments are defined over positions, masked ones included (a tool-output span still holds text
and newlines); masked tokens only drop out of the counts in the objective.
"""

from __future__ import annotations

import torch


def build_newline_table(tokenizer, vocab_size: int | None = None) -> torch.Tensor:
    """Which token ids decode to text that contains ``"\\n"``.

    Args:
        tokenizer: a ``transformers`` tokenizer (anything with ``batch_decode`` and ``len``).
        vocab_size: length of the table; defaults to ``len(tokenizer)``. Pass the model's
            embedding size when it is larger than the tokenizer (padded vocabularies): ids the
            tokenizer does not know are never newlines.

    Returns:
        Bool tensor of shape (vocab_size,), on CPU. Build it once per tokenizer.

    Raises:
        ValueError: ``vocab_size`` is smaller than the tokenizer's vocabulary.
    """
    n = len(tokenizer)
    size = n if vocab_size is None else int(vocab_size)
    if size < n:
        raise ValueError(
            f"vocab_size={size} is smaller than the tokenizer's {n} tokens: pass the model's "
            "embedding size (model.get_input_embeddings().num_embeddings) or leave it unset."
        )
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    table = torch.zeros(size, dtype=torch.bool)
    table[:n] = torch.tensor(["\n" in t for t in texts], dtype=torch.bool)
    return table


def segment_ids(
    completion_ids: torch.Tensor,
    *,
    mode: str = "newline",
    max_tokens: int = 64,
    newline_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row segment index of every completion position.

    Args:
        completion_ids: (B, T) integer token ids of the completions (padding included).
        mode: ``"newline"`` or ``"fixed"`` (``TriageConfig.triage_segment_mode``).
        max_tokens: longest segment in tokens (``triage_segment_max_tokens``), >= 1.
        newline_table: (V,) bool table from :func:`build_newline_table`; required in ``newline`` mode.

    Returns:
        (B, T) int32 tensor on ``completion_ids.device``: 0 for the first segment of each row,
        increasing by one at each segment start. Values lie in [0, T).

    Raises:
        ValueError: unknown mode, ``max_tokens < 1``, a missing table in ``newline`` mode, a
            non-2-D or non-integer ``completion_ids``, or ids outside the table.
    """
    if completion_ids.dim() != 2 or completion_ids.is_floating_point():
        raise ValueError(
            f"completion_ids must be a 2-D integer tensor (B, T); got shape {tuple(completion_ids.shape)} "
            f"and dtype {completion_ids.dtype}."
        )
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} is out of range: it must be an integer >= 1.")
    if mode not in ("newline", "fixed"):
        raise ValueError(f"mode={mode!r} is invalid: it must be 'newline' or 'fixed'.")
    B, T = completion_ids.shape
    device = completion_ids.device
    positions = torch.arange(T, device=device, dtype=torch.int32)
    if mode == "fixed":
        return torch.div(positions, max_tokens, rounding_mode="floor").expand(B, T).contiguous()
    if newline_table is None:
        raise ValueError(
            "newline segments need a newline table: build it once with "
            "triage_trl.build_newline_table(tokenizer), or use mode='fixed'."
        )
    if completion_ids.numel() and (completion_ids.min() < 0 or completion_ids.max() >= newline_table.numel()):
        raise ValueError(
            f"completion_ids hold ids outside [0, {newline_table.numel()}): build the newline table "
            "with vocab_size=<the model's embedding size>."
        )
    if T == 0:
        return torch.zeros(B, 0, dtype=torch.int32, device=device)
    ends_line = newline_table.to(device).index_select(0, completion_ids.reshape(-1)).view(B, T)
    # Offset of each token within its line: t - (1 + position of the last newline before t).
    # (int32 throughout: int64 cumsum/cummax cost several times more on CPU.)
    last_end = (ends_line * (positions + 1)).cummax(dim=1).values
    offset = positions.expand(B, T).clone()
    offset[:, 1:] -= last_end[:, :-1]
    # A line is also cut after every max_tokens tokens; a lookup over offsets avoids a modulo pass.
    cut = (positions % max_tokens == max_tokens - 1).index_select(0, offset.reshape(-1)).view(B, T)
    ends = ends_line | cut
    return ends.cumsum(dim=1, dtype=torch.int32) - ends.to(torch.int32)
