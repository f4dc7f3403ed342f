"""One model resolver for every command: a name the CLI accepts (the embedded default, a tiny offline model), a local
folder or a Hub id -> what ``from_pretrained`` and vLLM load."""

from __future__ import annotations

import os

from .smollm2 import SMOLLM2, model_cache_dir, resolve_model_path

TINY_MODEL = "tiny-qwen3"
"""``model_name_or_path`` value that builds a tiny random Qwen3 offline (:func:`.tiny.save_tiny_qwen3`)."""


def resolve_model(name: str | None, work_dir: str | None = None) -> str:
    """The model folder or Hub id to load: the one resolver of every command (``triage-grpo``, ``triage-eval``, the
    demo, the lab).

    ``None`` or ``smollm2-135m-instruct`` is the embedded default (converted once into the model cache,
    :mod:`.smollm2`); ``tiny-qwen3`` is built offline into ``work_dir/tiny-qwen3`` (the model cache when
    ``work_dir`` is ``None``); a local folder or a Hub id passes through.

    Raises:
        FileNotFoundError: ``name`` looks like a local path (starts with ``.``, ``/`` or ``~``) that does not exist.
    """
    if name is None or name == SMOLLM2:
        return resolve_model_path(SMOLLM2)
    if name == TINY_MODEL:
        from .tiny import save_tiny_qwen3

        path = os.path.join(model_cache_dir() if work_dir is None else work_dir, TINY_MODEL)
        if not os.path.isfile(os.path.join(path, "config.json")):
            save_tiny_qwen3(path)
        return path
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise FileNotFoundError(
            f"Model folder {name} does not exist: give a local folder with config.json, a Hub id, "
            f"`{SMOLLM2}` (the embedded default) or `{TINY_MODEL}` (a tiny offline model)."
        )
    return os.path.expanduser(name)
