"""``sampler.frozen_vocab.FrozenVocabSkip``: which vocabulary matrices a weight sync leaves out (no engine needed; the
engine-side behaviour is tested in ``tests/test_sampler_engine.py``)."""

import logging

import torch
from torch import nn

from triage_trl.sampler.frozen_vocab import FrozenVocabSkip


class TinyLM(nn.Module):
    def __init__(self, tied: bool = False, head_bias: bool = False):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=head_bias)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def export(model, head=None):
    """What the export yields: parameters as stored, a slice of the embedding's storage, and the head (or a copy of
    it standing for a merged or re-quantised head)."""
    pairs = [("embed.weight", model.embed.weight.detach()), ("embed.slice", model.embed.weight.detach()[:4]),
             ("proj.weight", model.proj.weight.detach()), ("head.weight", model.head.weight.detach() if head is None
                                                           else head)]
    if model.head.bias is not None:
        pairs.append(("head.bias", model.head.bias.detach()))
    return pairs


def sync(skip, model, enabled=True, head=None):
    skip.plan(model, enabled=enabled)
    names = [name for name, _ in skip.filter(export(model, head))]
    skip.commit()
    return names


def freeze(*params):
    for p in params:
        p.requires_grad_(False)


def test_frozen_matrices_are_left_out_once_the_engine_holds_them():
    model, skip = TinyLM(), FrozenVocabSkip()
    everything = ["embed.weight", "embed.slice", "proj.weight", "head.weight"]
    assert sync(skip, model) == everything  # trainable: always sent
    freeze(model.embed.weight, model.head.weight)
    assert sync(skip, model) == everything and skip.input_embedding_sent  # first sync as frozen
    assert sync(skip, model) == ["embed.slice", "proj.weight"]  # a slice of the same storage still goes
    assert skip.skipped == ["embed.weight", "head.weight"] and not skip.input_embedding_sent
    with torch.no_grad():
        model.embed.weight.mul_(2.0)  # an in-place change advances the version counter
    assert sync(skip, model) == ["embed.weight", "embed.slice", "proj.weight"] and skip.input_embedding_sent
    assert sync(skip, model, enabled=False) == everything  # sharded learners, sleep mode: nothing left out


def test_a_tied_head_is_one_matrix():
    model, skip = TinyLM(tied=True), FrozenVocabSkip()
    freeze(model.embed.weight)
    sync(skip, model)
    assert sync(skip, model) == ["embed.slice", "proj.weight"]
    assert skip.skipped == ["embed.weight", "head.weight"]  # both names point at the one frozen matrix


def test_a_head_with_a_bias_is_always_sent():
    """vLLM loads head weight and bias into one layer; a layer that receives only its bias is rebuilt from
    uninitialised memory."""
    model, skip = TinyLM(head_bias=True), FrozenVocabSkip()
    freeze(model.embed.weight, model.head.weight, model.head.bias)
    sync(skip, model)
    assert sync(skip, model) == ["embed.slice", "proj.weight", "head.weight", "head.bias"]


def test_only_what_was_sent_from_its_own_storage_counts_as_held():
    """A LoRA-merged (or re-quantised) head is a copy: the engine never held the frozen base weight, so switching
    the adapters off later must send it."""
    model, skip = TinyLM(), FrozenVocabSkip()
    freeze(model.head.weight)
    merged = model.head.weight.detach() + 0.5
    sync(skip, model, head=merged)
    sync(skip, model, head=merged)
    assert "head.weight" in sync(skip, model)  # adapters off: the base weight itself goes


def test_a_change_that_bypasses_the_version_counter_is_sent():
    model, skip = TinyLM(), FrozenVocabSkip()
    freeze(model.embed.weight)
    sync(skip, model)
    model.embed.weight.data.mul_(1.5)  # `.data` has a version counter of its own
    assert "embed.weight" in sync(skip, model)
    model.embed.weight = nn.Parameter(model.embed.weight.detach().clone(), requires_grad=False)  # a new parameter
    assert "embed.weight" in sync(skip, model)


def test_parameters_sharing_storage_are_left_out_only_together():
    model, skip = TinyLM(), FrozenVocabSkip()
    model.head.weight = nn.Parameter(model.embed.weight.data, requires_grad=False)  # another object, same storage
    freeze(model.embed.weight)
    sync(skip, model)
    with torch.no_grad():
        model.embed.weight.add_(1.0)  # the head's own version counter does not move
    assert "embed.weight" in sync(skip, model)


def test_a_failed_sync_commits_nothing():
    model, skip = TinyLM(), FrozenVocabSkip()
    freeze(model.embed.weight)
    skip.plan(model, enabled=True)
    list(skip.filter(export(model)))  # the reload raised: no commit()
    assert "embed.weight" in sync(skip, model)


def test_quiet_reload_drops_only_the_warnings_about_what_was_left_out():
    model, skip = TinyLM(), FrozenVocabSkip()
    freeze(model.embed.weight)
    sync(skip, model)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    runner = logging.getLogger("vllm.v1.worker.gpu_model_runner")
    handler, levels = Keep(), [layerwise.level, runner.level]
    for target in (layerwise, runner):
        target.addHandler(handler)
        target.setLevel(logging.WARNING)  # vLLM's own level (the project sets ERROR) would hide them all
    try:
        skip.plan(model, enabled=True)
        with skip.quiet_reload():
            list(skip.filter(export(model)))
            layerwise.warning("%s: Failed to load weights", "VocabParallelEmbedding")
            layerwise.warning("%s: Failed to load weights", "RMSNorm")
            runner.warning("Following weights were not loaded from checkpoint: %s", {"embed.weight"})
            runner.warning("Following weights were not loaded from checkpoint: %s", {"embed.weight", "norm.weight"})
        layerwise.warning("%s: Failed to load weights", "VocabParallelEmbedding")
    finally:
        for target, level in zip((layerwise, runner), levels):
            target.removeHandler(handler)
            target.setLevel(level)
    assert seen == ["RMSNorm: Failed to load weights",
                    "Following weights were not loaded from checkpoint: {'norm.weight'}",
                    "VocabParallelEmbedding: Failed to load weights"]
