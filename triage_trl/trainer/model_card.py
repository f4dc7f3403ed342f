"""The model card (``README.md``) of a TRIAGE run, built with ``huggingface_hub``'s ``ModelCard`` API.

:func:`build_model_card` renders ``triage_trl/templates/model_card.md`` (TRL's ``lm_model_card.md`` layout) with
metadata the Hub reads: ``base_model`` (the Hub id, also for local copies that carry a
:data:`~triage_trl.models.SOURCE_FILE` marker), ``license``, ``datasets``, ``pipeline_tag``, ``library_name``, ``tags``
and, once ``triage-eval --to-card`` has added results (``triage_trl/eval/card.py``), a ``model-index``. The body holds
the TRIAGE section (:func:`triage_card_section`): settings, kernels that ran, and the mismatch at the first and last
logged step, labelled with the ``step`` of the training logs. What the cards share (citations, :func:`md_cell`, the
base model and license, the Hub metadata) is ``triage_trl/hub/card.py``.
"""

from __future__ import annotations

import logging
import math
import os

from huggingface_hub import ModelCard

from ..hub.card import TRIAGE_PAPER, base_model_info, card_data, md_cell, md_row, package_version, render_card

__all__ = ["TRIAGE_PAPER", "build_model_card", "mismatch_summary", "trainer_model_card", "triage_card_section"]

logger = logging.getLogger(__name__)

RECONSTRUCTION_NOTE = (
    "The TRIAGE objective used here is reconstructed from the abstract of arXiv 2610.07043 (the only public part of "
    "the paper): every choice it makes is a named `triage_*` setting listed below, and it may differ from the "
    "authors' implementation."
)

# Mismatch metrics summarised first vs last logged step (names under `triage/`).
SUMMARY_METRICS = ("gap_abs_mean", "k3_kl", "amp_imbalance", "hot_segment_frac", "repaired_frac", "weight_mean")

def mismatch_summary(log_history: list[dict]) -> tuple[dict, dict] | None:
    """The :data:`SUMMARY_METRICS` at the first and the last logged training step that has them.

    Args:
        log_history: ``trainer.state.log_history``: TRL's records ``{"step": int, "triage/<metric>": float, ...}``
            (each value already the mean over the logging window).

    Returns:
        ``(first, last)`` dicts ``{"step": <the log's step>, "<metric>": float}`` (NaN where a record lacks a
        metric), or ``None`` when no record has TRIAGE metrics.
    """
    rows = [r for r in log_history if any(f"triage/{name}" in r for name in SUMMARY_METRICS)]
    if not rows:
        return None

    def pick(record):
        out = {"step": record.get("step")}
        for name in SUMMARY_METRICS:
            value = record.get(f"triage/{name}", math.nan)
            out[name] = float(value) if value is not None else math.nan
        return out

    return pick(rows[0]), pick(rows[-1])


def triage_card_section(
    *,
    triage_settings: dict,
    nvfp4_settings: dict,
    kernels: dict,
    log_history: list[dict],
    sync_probe_gaps: list[float],
) -> str:
    """Markdown of the card's TRIAGE section.

    Args:
        triage_settings: ``TriageConfig.triage_settings()``.
        nvfp4_settings: ``TriageGRPOConfig.nvfp4_settings()``.
        kernels: which kernels/paths ran, e.g. ``{"sampler": "...", "learner": "..."}`` (strings).
        log_history: ``trainer.state.log_history`` (see :func:`mismatch_summary`).
        sync_probe_gaps: ``triage/sync_probe_gap`` values, one per probed weight sync (nats).
    """
    lines = ["## TRIAGE", "", RECONSTRUCTION_NOTE, "", "### Settings", "", "| setting | value |", "|---|---|"]
    for name, value in {**triage_settings, **nvfp4_settings}.items():
        lines.append(md_row(md_cell(name, code=True), md_cell(value, code=True)))
    lines += ["", "### Kernels that ran", ""]
    if kernels:
        lines += [f"- **{part}**: {md_cell(desc)}" for part, desc in kernels.items()]
    else:
        lines.append("- (no report: the run used no vLLM sampler and no NVFP4 learner)")
    lines += ["", "### Mismatch (learner minus sampler log-probs, nats), first vs last logged step", ""]
    summary = mismatch_summary(log_history)
    if summary is None:
        lines.append("No TRIAGE metrics were logged (triage_mode='off' or no training step).")
    else:
        first, last = summary
        lines += [md_row("metric", md_cell(f"step {first['step']}"), md_cell(f"step {last['step']}")), "|---|---|---|"]
        for name in SUMMARY_METRICS:
            lines.append(md_row(md_cell(f"triage/{name}", code=True), f"{first[name]:.4g}", f"{last[name]:.4g}"))
    if sync_probe_gaps:
        finite = [g for g in sync_probe_gaps if math.isfinite(g)]
        top = max(finite) if finite else float("nan")
        lines += [
            "",
            f"Sync probe (`triage/sync_probe_gap`, mean |learner - sampler| log-prob of a fixed sequence after "
            f"{len(sync_probe_gaps)} probed weight syncs): first {sync_probe_gaps[0]:.4g}, last {sync_probe_gaps[-1]:.4g}, "
            f"max {top:.4g} nats.",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the card


def build_model_card(
    *,
    model_name: str,
    model_name_or_path: str | None,
    model_id: str,
    trainer_name: str,
    paper: dict,
    tags: list[str],
    triage_section: str,
    dataset_name: str | None = None,
    wandb_url: str | None = None,
    trackio_url: str | None = None,
    comet_url: str | None = None,
) -> ModelCard:
    """Render the run's card from ``triage_trl/templates/model_card.md``.

    Args:
        model_name: the card's title and ``model-index`` name (e.g. the output folder's name).
        model_name_or_path: what the trainer loaded (``config._name_or_path``): a Hub id or a local folder.
        model_id: what the quick start loads: the Hub repo when pushing, else the output folder.
        trainer_name: e.g. ``"TRIAGE-GRPO"``. paper: ``{"title", "id", "citation"}`` (:data:`TRIAGE_PAPER`).
        tags: Hub tags. triage_section: :func:`triage_card_section`'s markdown.
        dataset_name: a Hub dataset id, recorded in ``datasets`` and linked; ``None`` records none.
        wandb_url, trackio_url, comet_url: tracker links shown as badges, as TRL's card does.

    Returns:
        The :class:`huggingface_hub.ModelCard` (``card.save(path)`` writes it).
    """
    info = base_model_info(model_name_or_path)
    if info["license"] is None:
        logger.warning(
            "The model card has no `license`: %s names none (no marker, no cached Hub card). Set it with "
            "`card = ModelCard.load(path); card.data.license = ...; card.save(path)`.", model_name_or_path)
    data = card_data(
        base_model=info["base_model"],
        datasets=[dataset_name] if dataset_name else None,
        license=info["license"],
        model_name=model_name,
        tags=["generated_from_trainer", *tags],
    )
    return render_card(
        "model_card.md",
        data,
        model_name=model_name,
        base_model=info["base_model"],
        base_model_note=info["note"],
        model_path=model_name_or_path,
        model_id=model_id,
        dataset_name=dataset_name,
        trainer_name=trainer_name,
        trainer_citation=paper.get("citation"),
        paper_title=paper.get("title"),
        paper_id=paper.get("id"),
        triage_section=triage_section,
        wandb_url=wandb_url,
        trackio_url=trackio_url,
        comet_url=comet_url,
        **{f"{p}_version": package_version(p if p != "pytorch" else "torch")
           for p in ("trl", "transformers", "pytorch", "datasets", "tokenizers")},
    )


def trainer_model_card(trainer, *, model_name=None, dataset_name=None, tags=None) -> ModelCard:
    """The card of a ``TriageGRPOTrainer`` run: TRL's tags and tracker links (TRL's helpers), the run's settings,
    kernels, mismatch and probe gaps (:func:`triage_card_section`), rendered by :func:`build_model_card`."""
    import sys

    from trl.trainer.utils import get_comet_experiment_url, get_config_model_id, get_trackio_space_url

    tags = {tags} if isinstance(tags, str) else set(tags or ())
    tags.update(trainer._tag_names)
    if "JOB_ID" in os.environ:
        tags.add("hf_jobs")
    trackio_url = get_trackio_space_url()
    if trackio_url is not None:
        tags = {t for t in tags if not t.startswith("trackio:")} | {f"trackio:{trackio_url}"}
    wandb = sys.modules.get("wandb")
    args = trainer.args
    return build_model_card(
        model_name=model_name or os.path.basename(os.path.normpath(args.output_dir)),
        model_name_or_path=get_config_model_id(trainer.model.config),
        model_id=getattr(trainer, "hub_model_id", None) or args.hub_model_id or args.output_dir,
        trainer_name=trainer._name,
        paper=trainer._paper,
        tags=sorted(tags),
        triage_section=triage_card_section(
            triage_settings=args.triage_settings(),
            nvfp4_settings=args.nvfp4_settings(),
            kernels=trainer.kernel_report(),
            log_history=trainer.state.log_history,
            sync_probe_gaps=trainer.sync_probe_gaps,
        ),
        dataset_name=dataset_name,
        wandb_url=wandb.run.url if wandb is not None and getattr(wandb, "run", None) is not None else None,
        trackio_url=trackio_url,
        comet_url=get_comet_experiment_url(),
    )


