"""Segment ids (step 4 of docs/objective.md): newline table from a real tokenizer, newline and fixed modes."""

import pytest
import torch

from objective_reference import reference_segment_ids
from triage_trl import build_newline_table, segment_ids
from triage_trl.testing import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_newline_table_marks_exactly_the_tokens_whose_text_has_a_newline(tokenizer):
    table = build_newline_table(tokenizer)
    assert table.dtype == torch.bool and table.shape == (len(tokenizer),)
    for i in range(len(tokenizer)):
        assert bool(table[i]) == ("\n" in tokenizer.decode([i])), i
    assert 0 < int(table.sum()) < len(tokenizer)
    padded = build_newline_table(tokenizer, vocab_size=len(tokenizer) + 37)
    assert padded.shape == (len(tokenizer) + 37,) and not padded[len(tokenizer):].any()
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_newline_table(tokenizer, vocab_size=10)


def test_newline_segments_on_real_text(tokenizer):
    text = "First, 12 - 5 = 7.\nSo the final answer is 7.\n\\boxed{7}"
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    seg = segment_ids(ids, mode="newline", max_tokens=64, newline_table=build_newline_table(tokenizer))
    pieces = {}
    for tok, s in zip(ids[0].tolist(), seg[0].tolist()):
        pieces.setdefault(s, []).append(tok)
    lines = [tokenizer.decode(p) for _, p in sorted(pieces.items())]
    assert "".join(lines) == text
    assert len(lines) == 3 and all(line.endswith("\n") for line in lines[:-1])


def test_max_tokens_cuts_long_lines_and_restarts_after_newline():
    table = torch.tensor([False, True])  # token 1 is a newline
    ids = torch.tensor([[0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0]])
    seg = segment_ids(ids, mode="newline", max_tokens=3, newline_table=table)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 5]]
    assert seg.tolist() == reference_segment_ids(ids.tolist(), "newline", 3, {1})


def test_fixed_windows():
    ids = torch.zeros(2, 7, dtype=torch.long)
    assert segment_ids(ids, mode="fixed", max_tokens=3).tolist() == [[0, 0, 0, 1, 1, 1, 2]] * 2
    assert segment_ids(ids, mode="fixed", max_tokens=1).tolist() == [list(range(7))] * 2


def test_random_batches_match_reference():
    g = torch.Generator().manual_seed(0)
    table = torch.rand(50, generator=g) < 0.1
    newline_ids = set(table.nonzero().view(-1).tolist())
    for max_tokens in (1, 2, 5, 64):
        ids = torch.randint(0, 50, (7, 93), generator=g)
        for mode in ("newline", "fixed"):
            got = segment_ids(ids, mode=mode, max_tokens=max_tokens, newline_table=table)
            assert got.tolist() == reference_segment_ids(ids.tolist(), mode, max_tokens, newline_ids)
            assert got.dtype == torch.int32 and int(got.max()) < ids.shape[1]


def test_bad_input():
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="newline table"):
        segment_ids(ids, mode="newline")
    with pytest.raises(ValueError, match="'newline' or 'fixed'"):
        segment_ids(ids, mode="sentences", newline_table=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_tokens=0"):
        segment_ids(ids, mode="fixed", max_tokens=0)
    with pytest.raises(ValueError, match="2-D integer"):
        segment_ids(ids.float(), mode="fixed")
    with pytest.raises(ValueError, match="outside"):
        segment_ids(ids + 10, mode="newline", newline_table=torch.zeros(4, dtype=torch.bool))
    assert segment_ids(torch.zeros(2, 0, dtype=torch.long), mode="newline", newline_table=torch.zeros(4, dtype=torch.bool)).shape == (2, 0)
