"""A weight sync leaves out the frozen vocabulary matrices the engine already holds.

LoRA (and any run that freezes the embeddings) never changes the input embedding or an untied output head, yet they
are the largest tensors of a small model (SmolLM2-135M: 28M of its 135M parameters, 113 MB in float32), and on vLLM
0.31's CPU platform a reload that receives one also re-packs it for oneDNN (the embedding layer's GEMM, then the tied
``lm_head``: ``cpu_reload.refresh_cpu_lm_heads``). Measured on the demo's LoRA sync (2-core AMD EPYC, AVX2): those
steps cost about 0.2 s of a 2.0 s sync and probe.

The rule (:class:`FrozenVocabSkip`): a sync leaves a vocabulary matrix out when it is a frozen parameter
(``requires_grad`` False) of a learner whose parameters are whole on this rank (not FSDP2, not ZeRO-3) and its storage
and version counter are what they were when the engine last received it. In-place updates (optimizer steps,
``copy_``, ``load_state_dict``) advance the version counter; a write through ``.data`` does not, and then the sync probe
finds the sampler stale (``triage_trl.trainer.sync_probe``). Only the vocabulary matrices: each is the only tensor of
its vLLM layer, so a layer receives all its tensors or none, and vLLM's layerwise reload puts a layer that received
nothing back as it was (``model_executor/model_loader/reload/layerwise.py``, with a warning :meth:`quiet_reload`
drops for the skipped layers only).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..models.blocks import hf_model

__all__ = ["FrozenVocabSkip"]

_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOT_LOADED = "%s: Failed to load weights"
_VOCAB_LAYERS = ("VocabParallelEmbedding", "ParallelLMHead")


class FrozenVocabSkip:
    """Per sampler: which frozen vocabulary matrices the engine holds, and which a sync may leave out.

    Use per sync: :meth:`plan` (before the export), :meth:`filter` on the export's ``(name, tensor)`` pairs,
    :meth:`quiet_reload` around the reload, :meth:`commit` after it succeeded. One per engine: a new engine holds only
    its start checkpoint's weights.

    Attributes:
        skipped: checkpoint names the last sync left out.
        input_embedding_sent: whether the last sync sent the input embedding (a tied ``lm_head`` needs re-packing
            only then).
    """

    def __init__(self):
        # id(parameter) -> (a weak reference to it, (data_ptr, version) when sent): the reference tells a parameter
        # from a later one that reuses a freed one's id and address
        self._served: dict[int, tuple[weakref.ref, tuple[int, int]]] = {}
        self._plan: dict[int, nn.Parameter] = {}
        self._sending: dict[int, tuple[weakref.ref, tuple[int, int]]] = {}
        self.skipped: list[str] = []
        self.input_embedding_sent = True

    def plan(self, model: nn.Module, *, whole: bool) -> None:
        """Choose this sync's skips: the frozen vocabulary matrices of ``model`` unchanged since the engine received
        them. ``whole``: the learner's parameters are whole on this rank (nothing is skipped otherwise)."""
        self.skipped, self._plan, self._sending = [], {}, {}
        self.input_embedding_sent = True
        if not whole:
            return
        inner = hf_model(model)
        matrices: list[nn.Parameter] = []
        for get in ("get_input_embeddings", "get_output_embeddings"):
            getter = getattr(inner, get, None)
            weight = getattr(getter() if getter is not None else None, "weight", None)
            if isinstance(weight, nn.Parameter) and all(weight is not m for m in matrices):
                matrices.append(weight)
        for weight in matrices:
            if weight.requires_grad or weight.is_meta:
                continue
            state = (weight.data_ptr(), weight._version)
            ref, served = self._served.get(id(weight), (None, None))
            if ref is not None and ref() is weight and served == state:
                self._plan[weight.data_ptr()] = weight
            else:
                self._sending[id(weight)] = (weakref.ref(weight), state)
        embedding = getattr(getattr(inner, "get_input_embeddings", lambda: None)(), "weight", None)
        self.input_embedding_sent = embedding is None or embedding.data_ptr() not in self._plan

    def filter(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``pairs`` without the planned skips (a tensor that is the whole planned parameter: same data pointer and
        shape), recording their names in :attr:`skipped`."""
        for name, tensor in pairs:
            weight = self._plan.get(tensor.data_ptr())
            if weight is not None and tensor.shape == weight.shape:
                self.skipped.append(name)
                continue
            yield name, tensor

    @contextlib.contextmanager
    def quiet_reload(self) -> Iterator[None]:
        """Drop vLLM's "Failed to load weights" warning for vocabulary layers while a sync that skipped one reloads
        (vLLM then puts those layers back as they were); every other record passes."""
        if not self._plan:
            yield
            return
        reload_logger = logging.getLogger(_RELOAD_LOGGER)

        def keep(record: logging.LogRecord) -> bool:
            return not (record.msg == _NOT_LOADED and record.args and record.args[0] in _VOCAB_LAYERS)

        reload_logger.addFilter(keep)
        try:
            yield
        finally:
            reload_logger.removeFilter(keep)

    def commit(self) -> None:
        """Record the frozen matrices this sync sent (call after the reload succeeded)."""
        self._served.update(self._sending)
        self._sending = {}
