"""``transformers.Trainer`` callback that keeps the NVFP4 learner's weight caches fresh.

The emulated NVFP4 layers cache their fake-quantised weights per weight generation
(``triage_trl.nvfp4.emulated.NVFP4WeightGeneration``); this callback advances it wherever the Trainer may have
changed the weights: after every optimizer step that trains an NVFP4 layer's weight (also under DeepSpeed and FSDP2,
whose in-place writes bump no tensor version; not under LoRA on a frozen base), at the start of training (after a checkpoint was loaded) and at its end (after the best model was
loaded back).
"""

from __future__ import annotations

from transformers import TrainerCallback

from .learner import invalidate_nvfp4_weight_caches

__all__ = ["NVFP4WeightCacheCallback"]


class NVFP4WeightCacheCallback(TrainerCallback):
    """Calls ``invalidate_nvfp4_weight_caches(model)`` on ``on_train_begin``, ``on_optimizer_step`` and
    ``on_train_end``."""

    def _invalidate(self, model, trainable_only: bool = False) -> None:
        if model is not None:
            invalidate_nvfp4_weight_caches(model, trainable_only=trainable_only)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._invalidate(model)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._invalidate(model, trainable_only=True)  # a frozen NVFP4 base under LoRA did not change

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._invalidate(model)
