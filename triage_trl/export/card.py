"""The model card of an NVFP4 export: the run's base model with ``base_model_relation: quantized``, its license and
datasets, the TRIAGE run and weights it came from, and how to serve it (``vllm serve``).

Rendered from ``triage_trl/templates/nvfp4_export_card.md`` with ``huggingface_hub.ModelCard``.
"""

from __future__ import annotations

import logging

from huggingface_hub import ModelCard

from ..hub.card import TRIAGE_BIBTEX, base_model_info, card_data, md_cell, render_card
from .source import ExportSource

logger = logging.getLogger(__name__)

EXPORT_TAGS = ["triage", "trl", "grpo", "nvfp4", "compressed-tensors", "vllm"]


def run_card_metadata(source: ExportSource) -> dict:
    """``{"base_model", "license", "datasets"}`` of the run: from its own card when it has one, else from the model
    its record names (``hub.card.base_model_info``, no network); missing values are ``None``."""
    meta = {"base_model": None, "license": None, "datasets": None}
    if source.run_card is not None:
        data = ModelCard.load(source.run_card, ignore_metadata_errors=True).data
        meta.update(base_model=data.base_model, license=data.license, datasets=data.datasets)
    if meta["base_model"] is None and source.record and source.record.get("model_name_or_path"):
        info = base_model_info(source.record["model_name_or_path"])
        meta["base_model"], meta["license"] = info["base_model"], meta["license"] or info["license"]
    if isinstance(meta["base_model"], list):
        meta["base_model"] = meta["base_model"][0] if meta["base_model"] else None
    return meta


def export_card(
    source: ExportSource,
    *,
    model_name: str,
    serve_path: str,
    selection,
    nvfp4_settings: dict,
    calibration: str,
    base_model: str | None = None,
) -> ModelCard:
    """The export's card.

    Args:
        source: what was exported (run folder, checkpoint, step).
        model_name: the card's title (the output folder's or Hub repo's name).
        serve_path: what ``vllm serve`` is given in the card: the Hub repo id when pushing, else the output folder.
        selection: the ``NVFP4LayerSelection`` exported.
        nvfp4_settings: the NVFP4 settings of the selection (shown in a table).
        calibration: where the activation scales come from, one sentence.
        base_model: overrides the run's base model (e.g. the Hub repo of the trained run).

    Returns:
        The ``ModelCard``; ``card.data`` holds ``base_model``, ``base_model_relation="quantized"``, ``license``,
        ``datasets``, ``pipeline_tag``, ``library_name`` and ``tags``.
    """
    meta = run_card_metadata(source)
    base = base_model or meta["base_model"]
    if base is None:
        logger.warning("The export's card has no base_model: the run names no Hub model (pass --base-model ID).")
    data = card_data(base_model=base, base_model_relation="quantized" if base else None, datasets=meta["datasets"],
                     license=meta["license"], model_name=model_name, tags=EXPORT_TAGS)
    weights = source.checkpoint or "final weights"
    if source.step is not None:
        weights += f", step {source.step}"
    return render_card(
        "nvfp4_export_card.md",
        data,
        model_name=model_name,
        run_name=source.run_dir.resolve().name,
        weights_label=weights,
        base_model=base,
        serve_path=serve_path,
        nvfp4_layers=len(selection.nvfp4_layers),
        bf16_layers=len(selection.kept_layers),
        nvfp4_settings=md_cell(", ".join(f"{k}={v!r}" for k, v in nvfp4_settings.items())),
        calibration=md_cell(calibration),
        citation=TRIAGE_BIBTEX,
    )
