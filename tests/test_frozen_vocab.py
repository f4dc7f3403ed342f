"""``sampler.frozen_vocab.FrozenVocabSkip``: which vocabulary matrices a weight sync leaves out (no engine needed; the
engine-side behaviour is tested in ``tests/test_sampler_engine.py``)."""

import logging

import torch
from torch import nn

from triage_trl.sampler.frozen_vocab import FrozenVocabSkip


class TinyLM(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def export(model):
    return [("embed.weight", model.embed.weight.detach()), ("embed.slice", model.embed.weight.detach()[:4]),
            ("proj.weight", model.proj.weight.detach()), ("head.weight", model.head.weight.detach())]


def sync(skip, model, whole=True):
    skip.plan(model, whole=whole)
    names = [name for name, _ in skip.filter(export(model))]
    skip.commit()
    return names


def test_frozen_matrices_are_left_out_once_the_engine_holds_them():
    model, skip = TinyLM(tied=False), FrozenVocabSkip()
    everything = ["embed.weight", "embed.slice", "proj.weight", "head.weight"]
    assert sync(skip, model) == everything  # trainable: always sent
    model.embed.weight.requires_grad_(False)
    model.head.weight.requires_grad_(False)
    assert sync(skip, model) == everything and skip.input_embedding_sent  # first sync as frozen
    assert sync(skip, model) == ["embed.slice", "proj.weight"]  # a slice of the same storage still goes
    assert skip.skipped == ["embed.weight", "head.weight"] and not skip.input_embedding_sent
    with torch.no_grad():
        model.embed.weight.mul_(2.0)  # an in-place change advances the version counter
    assert sync(skip, model) == ["embed.weight", "embed.slice", "proj.weight"] and skip.input_embedding_sent
    assert sync(skip, model, whole=False) == everything  # sharded learners: nothing left out


def test_a_new_parameter_in_place_of_a_freed_one_is_sent():
    model, skip = TinyLM(tied=False), FrozenVocabSkip()
    model.embed.weight.requires_grad_(False)
    sync(skip, model)
    model.embed.weight = nn.Parameter(model.embed.weight.detach().clone(), requires_grad=False)
    assert "embed.weight" in sync(skip, model)


def test_a_tied_head_is_one_matrix():
    model, skip = TinyLM(tied=True), FrozenVocabSkip()
    model.embed.weight.requires_grad_(False)
    sync(skip, model)
    assert sync(skip, model) == ["embed.slice", "proj.weight"]
    assert skip.skipped == ["embed.weight", "head.weight"]  # both names point at the one frozen matrix


def test_a_failed_reload_commits_nothing():
    model, skip = TinyLM(tied=False), FrozenVocabSkip()
    model.embed.weight.requires_grad_(False)
    skip.plan(model, whole=True)
    list(skip.filter(export(model)))  # the reload raised: no commit()
    assert "embed.weight" in sync(skip, model)  # so the next sync sends the matrix again


def test_quiet_reload_drops_only_the_skipped_layers_warning():
    model, skip = TinyLM(tied=False), FrozenVocabSkip()
    model.embed.weight.requires_grad_(False)
    sync(skip, model)
    skip.plan(model, whole=True)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    handler = Keep()
    reload_logger.addHandler(handler)
    try:
        with skip.quiet_reload():
            reload_logger.warning("%s: Failed to load weights", "VocabParallelEmbedding")
            reload_logger.warning("%s: Failed to load weights", "RMSNorm")
        reload_logger.warning("%s: Failed to load weights", "VocabParallelEmbedding")
    finally:
        reload_logger.removeHandler(handler)
    assert seen == ["RMSNorm: Failed to load weights", "VocabParallelEmbedding: Failed to load weights"]
