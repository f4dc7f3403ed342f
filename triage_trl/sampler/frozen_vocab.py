"""A weight sync leaves out the frozen vocabulary matrices the engine already holds.

LoRA (and any run that freezes the embeddings) never changes the input embedding or an untied output head, yet they
are the largest tensors of a small model (SmolLM2-135M: 28M of its 135M parameters, 113 MB in float32), and on vLLM
0.31's CPU platform a reload that receives one also re-packs it for oneDNN (the embedding layer's GEMM, then the tied
``lm_head``: ``cpu_reload.refresh_cpu_lm_heads``). Measured on the demo's LoRA sync (2-core AMD EPYC, AVX2): those
steps cost about 0.4 s of a 2.0 s sync and probe.

The rule (:class:`FrozenVocabSkip`): a sync leaves a vocabulary matrix out when

* it is a frozen parameter (``requires_grad`` False) of a learner whose parameters are whole on this rank (not
  FSDP2, not ZeRO-3) and whose engine keeps its weights between syncs (no sleep mode: level 2 discards them);
* its module holds no other tensor (a head with a bias is one vLLM layer with two tensors, and vLLM's layerwise
  reload rebuilds a layer that receives only some of its tensors from uninitialised memory);
* the engine received this very parameter's own values at an earlier sync (the export yielded its storage, not a
  merged or re-quantised copy), and the parameter is unchanged since: the same object (weak reference), storage,
  version counter and float32 sum. In-place updates (optimizer steps, ``copy_``, ``load_state_dict``) advance the
  version counter; a write that bypasses it (``.data``, a ``Module.to`` round trip that lands at the same address)
  changes the sum unless it keeps every value's total, and the sync probe (``triage_trl.trainer.sync_probe``)
  reports a sampler that missed a change as stale.

vLLM's layerwise reload puts a layer that received nothing back as it was
(``model_executor/model_loader/reload/layerwise.py``); :meth:`FrozenVocabSkip.quiet_reload` drops the warnings vLLM
logs about the matrices left out, and only those.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..models.blocks import hf_model
from .reload_warnings import NOT_FROM_CHECKPOINT, NOT_LOADED, filtered_reload_warnings

__all__ = ["FrozenVocabSkip"]

_VOCAB_LAYERS = ("VocabParallelEmbedding", "ParallelLMHead")


@dataclass
class _Matrix:
    weight: nn.Parameter
    fingerprint: tuple[int, int, float]  # data_ptr, version counter, float32 sum
    served: bool  # the engine holds these values (received at an earlier sync, unchanged since)


class FrozenVocabSkip:
    """Per engine: which frozen vocabulary matrices the engine holds, and which a sync may leave out.

    Use per sync: :meth:`plan` (before the export), :meth:`filter` on the export's ``(name, tensor)`` pairs (before
    any dtype cast), :meth:`quiet_reload` around the reload, :meth:`commit` once the sync is complete.

    Attributes:
        skipped: checkpoint names the last sync left out.
        input_embedding_sent: ``False`` when the last sync left the input embedding out (a tied ``lm_head`` then
            keeps its packed copy and needs no re-packing).
    """

    def __init__(self):
        self._held: dict[int, tuple[weakref.ref, tuple[int, int, float]]] = {}  # id(parameter) -> what was sent
        self._plan: dict[int, list[_Matrix]] = {}  # data_ptr -> the candidate matrices stored there
        self._embedding_ptr: int | None = None
        self._sent: list[_Matrix] = []
        self.skipped: list[str] = []
        self.input_embedding_sent = True

    def plan(self, model: nn.Module, *, enabled: bool) -> None:
        """Find this sync's candidates: the frozen vocabulary matrices of ``model`` whose module holds nothing else.
        ``enabled``: the learner is whole on this rank and the engine keeps its weights (nothing is left out
        otherwise)."""
        self._plan, self._sent, self.skipped = {}, [], []
        self._embedding_ptr, self.input_embedding_sent = None, True
        if not enabled:
            return
        inner = hf_model(model)
        for get in ("get_input_embeddings", "get_output_embeddings"):
            module = getattr(inner, get)() if callable(getattr(inner, get, None)) else None
            weight = getattr(module, "weight", None)
            if not isinstance(weight, nn.Parameter) or weight.requires_grad or weight.is_meta:
                continue
            if any(p is not weight for p in module.parameters()) or next(module.buffers(), None) is not None:
                continue
            if get == "get_input_embeddings":
                self._embedding_ptr = weight.data_ptr()
            candidates = self._plan.setdefault(weight.data_ptr(), [])
            if any(m.weight is weight for m in candidates):  # a tied head: the same parameter
                continue
            fingerprint = (weight.data_ptr(), weight._version, float(weight.detach().sum(dtype=torch.float32)))
            ref, held = self._held.get(id(weight), (None, None))
            candidates.append(_Matrix(weight, fingerprint, ref is not None and ref() is weight and held == fingerprint))

    def filter(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``pairs`` without the matrices the engine holds unchanged; a pair that is a candidate's own storage (same
        data pointer and shape) and is sent is recorded, so :meth:`commit` knows what the engine now holds."""
        for name, tensor in pairs:
            candidates = self._plan.get(tensor.data_ptr())
            if candidates and all(tensor.shape == m.weight.shape for m in candidates):
                if all(m.served for m in candidates):  # every parameter stored there unchanged
                    self.skipped.append(name)
                    if tensor.data_ptr() == self._embedding_ptr:
                        self.input_embedding_sent = False
                    continue
                self._sent.extend(candidates)
            yield name, tensor

    @contextlib.contextmanager
    def quiet_reload(self) -> Iterator[None]:
        """Drop the warnings vLLM logs about the matrices a sync left out (the layerwise reload's "Failed to load
        weights" for vocabulary layers, the model runner's list of weights not loaded, less those names); every other
        record passes."""
        skipped = self.skipped  # filled while the reload consumes the export

        def keep_layerwise(record: logging.LogRecord) -> bool:
            return not (skipped and record.msg == NOT_LOADED and record.args and record.args[0] in _VOCAB_LAYERS)

        def keep_runner(record: logging.LogRecord) -> bool:
            if not skipped or record.msg != NOT_FROM_CHECKPOINT or not record.args:
                return True
            rest = set(record.args[0]) - set(skipped)
            record.args = (rest,)
            return bool(rest)

        with filtered_reload_warnings(keep_layerwise, keep_runner):
            yield

    def commit(self) -> None:
        """Record what the engine now holds: the matrices this sync sent from their own storage (call once the sync
        is complete: the reload and everything after it)."""
        for matrix in self._sent:
            self._held[id(matrix.weight)] = (weakref.ref(matrix.weight), matrix.fingerprint)
        self._sent = []
