"""The shared-prompt learner forward (triage_trl/trainer/shared_prompt.py) against TRL's row-by-row forward."""

from __future__ import annotations

import contextlib

import pytest
import torch

from triage_trl.trainer.shared_prompt import (
    chunk_groups,
    pack_shared_prompts,
    prompt_groups,
    shared_prompt_logps,
    unsupported_reason,
)

P, C = 10, 6


def _rows(vocab: int):
    """7 rows: prompt A (3 left pads) x 3, prompt B x 3, prompt C x 1, interleaved; completions of varied length."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (3, P), generator=g)
    prompt_masks = torch.ones(3, P, dtype=torch.long)
    prompt_masks[0, :3] = 0
    prompts[0, :3] = 1  # pad id
    which = [0, 1, 0, 2, 1, 0, 1]
    completions = torch.randint(3, vocab, (len(which), C), generator=g)
    completion_masks = torch.ones(len(which), C, dtype=torch.long)
    for row, length in enumerate([6, 2, 4, 6, 1, 5, 3]):
        completion_masks[row, length:] = 0
        completions[row, length:] = 1
    ids = torch.cat([prompts[which], completions], dim=1)
    mask = torch.cat([prompt_masks[which], completion_masks], dim=1)
    return ids, mask


def _model(tmp_path, architecture: str, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from triage_trl.models.tiny import save_tiny_model

    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64)
    if architecture == "Qwen3Moe":
        shape.update(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[])
    save_tiny_model(tmp_path / architecture, architecture, **shape)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / architecture, dtype=torch.float32,
                                                 attn_implementation=attn)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def _trl_rows(model, ids, mask):
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-C] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -C:], out.entropy[:, -C:]


def _shared(model, ids, mask, batch_size=16, eager=False):
    groups = prompt_groups(ids[:, :-C], mask[:, :-C])
    return shared_prompt_logps(model, ids, mask, C, groups, batch_size=batch_size, compute_entropy=True,
                               eager_mask=eager, autocast=contextlib.nullcontext)


def _scored(fn, model):
    model.zero_grad()
    logps, entropy = fn()
    (logps.sum() + 0.1 * entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), entropy.detach(), grads


@pytest.mark.parametrize("architecture,attn,batch_size", [
    ("Qwen3", "sdpa", 16), ("Llama", "sdpa", 16), ("Llama", "eager", 16), ("Qwen3", "sdpa", 3), ("Qwen3Moe", "sdpa", 16),
])
def test_shared_prompt_forward_matches_trl_rows(tmp_path, architecture, attn, batch_size):
    model = _model(tmp_path, architecture, attn)
    ids, mask = _rows(model.get_input_embeddings().num_embeddings)
    trl = _scored(lambda: _trl_rows(model, ids, mask), model)
    shared = _scored(lambda: _shared(model, ids, mask, batch_size, eager=attn == "eager"), model)
    scored = mask[:, -C:].bool()
    assert scored.sum() == 27
    torch.testing.assert_close(shared[0], trl[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1], trl[1], atol=2e-5, rtol=1e-5)
    assert (shared[0][~scored] == 0).all() and (shared[0][scored] < 0).all()
    assert shared[2].keys() == trl[2].keys() and len(trl[2]) > 0
    for name, grad in trl[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=2e-5, rtol=1e-4, msg=name)


def test_groups_pack_each_prompt_once():
    ids, mask = _rows(64)
    groups = prompt_groups(ids[:, :-C], mask[:, :-C])
    assert groups == [[0, 2, 5], [1, 4, 6], [3]]
    packed = pack_shared_prompts(ids, mask, C, groups)
    # (P - 1) prompt positions once, then one block of C per completion
    assert packed.input_ids.shape == (3, P - 1 + 3 * C)
    assert packed.row_ids == list(range(7))
    assert packed.rows[0] == (0, P - 1) and packed.rows[2] == (0, P - 1 + C) and packed.rows[3] == (2, P - 1)
    # a completion token sees the prompt's tokens and its own block only
    m = packed.attention_mask[0, 0]
    second_block = P - 1 + C
    assert m[second_block + 2, :3].sum() == 0  # left padding
    assert m[second_block + 2, 3:P - 1].all() and not m[second_block + 2, P - 1:second_block].any()
    assert m[second_block + 2, second_block:second_block + 3].all()
    assert packed.position_ids[0, second_block:second_block + C].tolist() == list(range(P - 1, P - 1 + C))
    assert m.any(dim=-1).all()  # no empty softmax row


def test_chunks_keep_groups_whole():
    assert chunk_groups([[0, 1], [2, 3, 4], [5]], 3) == [[[0, 1]], [[2, 3, 4]], [[5]]]
    assert chunk_groups([[0, 1], [2], [3, 4, 5, 6]], 3) == [[[0, 1], [2]], [[3, 4, 5, 6]]]


def test_right_padded_prompt_is_refused():
    ids, mask = _rows(64)
    mask[0, P - 1] = 0
    with pytest.raises(ValueError, match="left-padded"):
        pack_shared_prompts(ids, mask, C, [[0, 2, 5]])


def test_unsupported_models_are_named():
    from transformers import GPT2Config, Qwen3Config

    assert unsupported_reason(Qwen3Config(), None) is None
    assert "not among the tested decoders" in unsupported_reason(GPT2Config(), "sdpa")
    windowed = Qwen3Config(use_sliding_window=True, max_window_layers=1, num_hidden_layers=2)
    assert "windowed attention" in unsupported_reason(windowed, "sdpa")
    assert "flash_attention_2" in unsupported_reason(Qwen3Config(), "flash_attention_2")


def test_positions_needed_counts_each_distinct_prompt_once():
    from triage_trl.trainer.shared_prompt import positions_needed

    ids, mask = _rows(64)
    assert positions_needed(ids, mask, C) == 3 * P + 7 * C  # 3 distinct prompts, 7 completions
    assert positions_needed(ids[:1], mask[:1], C) == P + C
