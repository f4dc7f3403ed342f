"""The learner's forward with each prompt scored once per group (``triage_shared_prompt_forward``).

A GRPO micro-batch holds ``num_generations`` completions of each prompt, and TRL's learner forward runs every row
whole: with the demo's batch (~113 prompt and ~21 completion tokens a row) ~85% of the tokens of each pass (loss,
reference, rollout-time) are the same prompt again. Here the rows that share a prompt are packed into one sequence,
``[prompt[:-1], (prompt[-1], c_1[:-1]), ..., (prompt[-1], c_K[:-1])]``, with a 4-D attention mask in which each
completion block sees the prompt and itself only, and the positions each token has in TRL's own rows (HF's default
``arange``, left padding included). The prompt's last token is repeated at the head of each block, so every
completion token is predicted from the same context, at the same position, as in TRL's forward: the same log-probs
and entropies up to float summation order. Gradients of the shared prompt positions are summed over the group by
autograd, as TRL's rows sum them. The completion tokens are scored through TRL's own fused LM head
(``fused_lm_head=True`` with pre-shifted ``shift_labels``), so temperature, soft-capping and the chunked kernel are
TRL's.

Supported (:func:`unsupported_reason`): the decoder types in :data:`SHARED_PROMPT_MODEL_TYPES` (tested ones), with
``sdpa`` or ``eager`` attention (flash kernels take no 4-D mask), no windowed (sliding) layers, text only,
left-padded prompts (TRL's), and no MoE load-balancing loss (its token mask is 2-D). Source: this project (a
reconstruction of the prefix sharing RL frameworks use; not from the TRIAGE paper).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHARED_PROMPT_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
"""Decoder types whose forward takes a custom 4-D mask and explicit ``position_ids`` as TRL's rows' positions
(each has an agreement test in ``tests/test_shared_prompt.py``)."""

SHARED_PROMPT_ATTENTION = ("sdpa", "eager")


def unsupported_reason(config, attn_implementation: str | None) -> str | None:
    """Why the shared-prompt forward cannot serve this model (``None``: it can).

    Args:
        config: the model's ``PretrainedConfig`` (its text config is read). attn_implementation: the attention
            kernel (``None``: transformers' default, ``sdpa``).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    if model_type not in SHARED_PROMPT_MODEL_TYPES:
        return (f"model type {model_type!r} is not among the tested decoders {', '.join(SHARED_PROMPT_MODEL_TYPES)} "
                "(a 4-D mask and explicit positions must reproduce its rows)")
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"its layers {sorted(layer_types)} include windowed attention (one 4-D mask serves every layer)"
    kernel = attn_implementation or "sdpa"
    if kernel not in SHARED_PROMPT_ATTENTION:
        return f"attn_implementation={kernel!r} takes no custom 4-D mask (use 'sdpa' or 'eager')"
    return None


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Row indices grouped by identical prompt (ids and padding), groups in order of first appearance.

    Args:
        prompt_ids, prompt_mask: (B, P) prompt token ids and their attention mask (1 = token).
    """
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, key in enumerate(inverse.tolist()):
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def positions_needed(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int) -> int:
    """Positions a learner forward of TRL's (B, P + C) rows must compute: each distinct prompt once, then every
    completion (the packed length without padding between groups; ``benchmarks/bench_step.py``'s floor)."""
    p = input_ids.size(1) - completion_length
    if p < 1:
        return input_ids.numel()
    groups = prompt_groups(input_ids[:, :p], attention_mask[:, :p])
    return len(groups) * p + input_ids.size(0) * completion_length


@dataclass
class SharedPromptBatch:
    """Packed rows for one forward (G packed sequences of length L) and where each original row's completion lies.

    Attributes:
        input_ids: (G, L) token ids (0 at padding). position_ids: (G, L) each token's position in TRL's row.
        attention_mask: (G, 1, L, L) bool, ``True`` = the query (dim 2) attends to the key (dim 3); every token
            sees at least itself, so no softmax row is empty.
        shift_labels: (G, L) the token each position predicts (-100: not scored).
        row_ids: the original rows packed, ascending. rows: for each of them, ``(packed row, first position)`` of
            its ``completion_length`` scored positions.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    shift_labels: torch.Tensor
    row_ids: list[int]
    rows: list[tuple[int, int]]
    completion_length: int

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """(G, L) per-position values (log-probs, entropies) -> (len(row_ids), C) per completion token."""
        c = self.completion_length
        return torch.stack([per_token[g, start:start + c] for g, start in self.rows])


def pack_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int,
                        groups: list[list[int]]) -> SharedPromptBatch:
    """Pack TRL's rows (left-padded prompt, right-padded completion) so each group's prompt is scored once.

    Args:
        input_ids, attention_mask: (B, P + C) TRL's ``prompt_completion_ids`` and attention mask.
        completion_length: C (TRL's ``logits_to_keep``).
        groups: row indices sharing one prompt (:func:`prompt_groups`); rows of ``groups`` only are packed.

    Raises:
        ValueError: a prompt whose last position is padding (right-padded prompts; TRL pads on the left).
    """
    c = completion_length
    p = input_ids.size(1) - c
    if p < 1:
        raise ValueError(f"completion_length={c} leaves no prompt in rows of {input_ids.size(1)} tokens.")
    head = p - 1  # prompt positions scored once; the prompt's last token heads each completion block
    device = input_ids.device
    lengths = [head + len(g) * c for g in groups]
    n, length = len(groups), max(lengths)
    ids = torch.zeros(n, length, dtype=input_ids.dtype, device=device)
    positions = torch.zeros(n, length, dtype=torch.long, device=device)
    labels = torch.full((n, length), -100, dtype=input_ids.dtype, device=device)
    key_ok = torch.zeros(n, length, dtype=torch.bool, device=device)
    block = torch.full((n, length), -2, dtype=torch.long, device=device)  # -1 prompt, k completion k, -2 padding
    rows: dict[int, tuple[int, int]] = {}
    block_positions = torch.arange(head, head + c, device=device)
    for g, members in enumerate(groups):
        first = members[0]
        if not bool(attention_mask[first, p - 1]):
            raise ValueError("The prompt's last position is padding: the shared-prompt forward needs left-padded "
                             "prompts (TRL's). Set triage_shared_prompt_forward=False.")
        ids[g, :head] = input_ids[first, :head]
        positions[g, :head] = torch.arange(head, device=device)
        key_ok[g, :head] = attention_mask[first, :head].bool()
        block[g, :head] = -1
        for k, row in enumerate(members):
            start = head + k * c
            ids[g, start] = input_ids[first, p - 1]
            ids[g, start + 1:start + c] = input_ids[row, p:p + c - 1]
            positions[g, start:start + c] = block_positions
            key_ok[g, start] = True
            key_ok[g, start + 1:start + c] = attention_mask[row, p:p + c - 1].bool()
            labels[g, start:start + c] = input_ids[row, p:].masked_fill(attention_mask[row, p:] == 0, -100)
            block[g, start:start + c] = k
            rows[row] = (g, start)
    index = torch.arange(length, device=device)
    causal = index[None, :] <= index[:, None]  # (L, L): key at or before the query
    same_or_prompt = (block[:, :, None] == block[:, None, :]) | (block[:, None, :] == -1)
    mask = causal[None] & same_or_prompt & key_ok[:, None, :]
    mask |= torch.eye(length, dtype=torch.bool, device=device)[None]
    row_ids = sorted(rows)
    return SharedPromptBatch(ids, positions, mask[:, None], labels, row_ids, [rows[r] for r in row_ids], c)


def chunk_groups(groups: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Consecutive groups in chunks of at most ``batch_size`` original rows (a larger group is a chunk alone):
    the memory bound of TRL's row chunks."""
    chunks, current, rows = [], [], 0
    for members in groups:
        if current and rows + len(members) > batch_size:
            chunks.append(current)
            current, rows = [], 0
        current.append(members)
        rows += len(members)
    if current:
        chunks.append(current)
    return chunks


def shared_prompt_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                        groups: list[list[int]], *, batch_size: int, compute_entropy: bool, eager_mask: bool,
                        autocast) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the completion tokens, each prompt scored once per group.

    Args:
        model: a causal LM patched with TRL's ``add_fused_lm_head`` (possibly wrapped: DDP, FSDP2, ZeRO, PEFT).
        input_ids, attention_mask: (B, P + C) TRL's rows. logits_to_keep: C. groups: :func:`prompt_groups` of
            every row. batch_size: original rows per forward (:func:`chunk_groups`). compute_entropy: also return
            entropies. eager_mask: pass the mask as additive floats (``eager`` attention) instead of bools.
        autocast: a context manager factory (``accelerator.autocast``).

    Returns:
        ``(log_probs, entropies)``: (B, C) in nats, 0 at padding, TRL's row order; ``entropies`` is ``None``
        unless ``compute_entropy``.
    """
    logps_parts, entropy_parts, order = [], [], []
    for chunk in chunk_groups(groups, batch_size):
        packed = pack_shared_prompts(input_ids, attention_mask, logits_to_keep, chunk)
        mask = packed.attention_mask
        if eager_mask:
            mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
                ~mask, torch.finfo(torch.float32).min)
        with autocast():
            out = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                        shift_labels=packed.shift_labels, fused_lm_head=True)
        logps_parts.append(packed.unpack(out.log_probs))
        if compute_entropy:
            entropy_parts.append(packed.unpack(out.entropy))
        order += packed.row_ids
    index = torch.tensor(order, device=input_ids.device)
    back = torch.argsort(index)
    logps = torch.cat(logps_parts).index_select(0, back)
    entropies = torch.cat(entropy_parts).index_select(0, back) if compute_entropy else None
    return logps, entropies
