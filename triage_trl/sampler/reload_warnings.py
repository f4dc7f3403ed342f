"""vLLM's warnings about the layers a ``reload_weights`` call received nothing for, and a way to drop the ones a
sync expects.

vLLM 0.31 logs ``"<LayerClass>: Failed to load weights"`` (layerwise reload, one record per layer, naming only its
class) and, for unquantised models, ``"Following weights were not loaded from checkpoint: {names}"`` (the model
runner). A sync that leaves layers out on purpose (``frozen_vocab.py``) or writes them directly (``direct_write.py``)
drops those records about its own layers and lets every other record pass.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

__all__ = ["LAYERWISE_LOGGER", "NOT_FROM_CHECKPOINT", "NOT_LOADED", "RUNNER_LOGGER", "filtered_reload_warnings"]

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
NOT_LOADED = "%s: Failed to load weights"
RUNNER_LOGGER = "vllm.v1.worker.gpu_model_runner"
NOT_FROM_CHECKPOINT = "Following weights were not loaded from checkpoint: %s"


@contextlib.contextmanager
def filtered_reload_warnings(keep_layerwise: Callable[[logging.LogRecord], bool],
                             keep_runner: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """Install ``keep_layerwise`` on vLLM's layerwise-reload logger and ``keep_runner`` on its model runner's logger
    (logging filters: ``False`` drops a record; they may rewrite a record's arguments) for the ``with`` block."""
    filters = [(logging.getLogger(LAYERWISE_LOGGER), keep_layerwise), (logging.getLogger(RUNNER_LOGGER), keep_runner)]
    for target, keep in filters:
        target.addFilter(keep)
    try:
        yield
    finally:
        for target, keep in filters:
            target.removeFilter(keep)
