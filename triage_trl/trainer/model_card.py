"""The model card (``README.md``) of a TRIAGE run, built with ``huggingface_hub``'s ``ModelCard`` API.

:func:`build_model_card` renders ``triage_trl/templates/model_card.md`` (TRL's ``lm_model_card.md`` layout) with
metadata the Hub reads: ``base_model`` (the Hub id, also for local copies that carry a
:data:`~triage_trl.models.SOURCE_FILE` marker), ``license``, ``datasets``, ``pipeline_tag``, ``library_name``, ``tags``
and, once :func:`add_eval_results_to_card` has added ``triage-eval`` results, a ``model-index``. The body holds the
TRIAGE section (:func:`triage_card_section`): settings, kernels that ran, and the mismatch at the first and last
logged step, labelled with the ``step`` of the training logs. Every markdown table cell goes through :func:`md_cell`.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import math
import os
import re
import textwrap
from importlib.metadata import PackageNotFoundError, version

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .. import __version__

logger = logging.getLogger(__name__)

TRIAGE_BIBTEX_KEY = "triage2026nvfp4"
"""The one citation key of the TRIAGE paper (README, ``CITATION.cff`` and cards)."""

TRIAGE_BIBTEX = textwrap.dedent(f"""\
    @article{{{TRIAGE_BIBTEX_KEY},
      title   = {{{{TRIAGE: Direction-Aware Mismatch Stabilization of Native NVFP4 Reinforcement Learning}}}},
      journal = {{arXiv preprint arXiv:2610.07043}},
      eprint  = {{2610.07043}},
      year    = {{2026}}
    }}""")

GRPO_BIBTEX = textwrap.dedent("""\
    @article{shao2024deepseekmath,
      title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
      author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},
      journal = {arXiv preprint arXiv:2402.03300},
      year    = {2024}
    }""")

TRIAGE_PAPER = {
    "title": "TRIAGE: Direction-Aware Mismatch Stabilization of Native NVFP4 Reinforcement Learning",
    "id": "2610.07043",
    "citation": f"{TRIAGE_BIBTEX}\n\n{GRPO_BIBTEX}",
}
"""TRL's ``_paper`` dict of :class:`TriageGRPOTrainer`."""

RECONSTRUCTION_NOTE = (
    "The TRIAGE objective used here is reconstructed from the abstract of arXiv 2610.07043 (the only public part of "
    "the paper): every choice it makes is a named `triage_*` setting listed below, and it may differ from the "
    "authors' implementation."
)

# Mismatch metrics summarised first vs last logged step (names under `triage/`).
SUMMARY_METRICS = ("gap_abs_mean", "k3_kl", "amp_imbalance", "hot_segment_frac", "repaired_frac", "weight_mean")

EVAL_SECTION_START = "<!-- triage-eval results: start -->"
EVAL_SECTION_END = "<!-- triage-eval results: end -->"


def md_cell(value, *, code: bool = False) -> str:
    """``value`` as one markdown table cell: ``|`` escaped, line breaks flattened, optionally as a code span.

    GitHub and the Hub split table rows at every unescaped ``|``, also inside code spans; ``\\|`` is shown as ``|``.
    """
    text = re.sub(r"\s*\n\s*", " ", str(value)).replace("|", "\\|")
    if not code:
        return text
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_row(*cells: str) -> str:
    """One table row from already-escaped cells (see :func:`md_cell`)."""
    return "| " + " | ".join(cells) + " |"


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
        sync_probe_gaps: ``triage/sync_probe_gap`` values measured after each weight sync (nats).
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
            f"Sync probe (`triage/sync_probe_gap`, mean |learner - sampler| log-prob of a fixed sequence after each of "
            f"{len(sync_probe_gaps)} weight syncs): first {sync_probe_gaps[0]:.4g}, last {sync_probe_gaps[-1]:.4g}, "
            f"max {top:.4g} nats.",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- base model, license


def base_model_info(model_name_or_path: str | None) -> dict:
    """The Hub base model of a run and its license, found without network.

    A Hub id is its own base model; a local folder names one through its :data:`~triage_trl.models.SOURCE_FILE`
    marker (written for the embedded SmolLM2). The license comes from the marker, else from the base model's card
    in the local Hub cache, else from a ``README.md`` card inside the local folder.

    Returns:
        ``{"base_model": str | None, "license": str | None, "note": str}``.
    """
    from ..models import read_model_source

    info = {"base_model": None, "license": None, "note": ""}
    if not model_name_or_path:
        return info
    if os.path.isdir(model_name_or_path):
        source = read_model_source(model_name_or_path) or {}
        info["base_model"], info["license"] = source.get("model_id"), source.get("license")
        info["note"] = source.get("note") or ""
        if info["license"] is None:
            info["license"] = _card_license(os.path.join(model_name_or_path, "README.md"))
    else:
        info["base_model"] = model_name_or_path
    if info["license"] is None and info["base_model"]:
        info["license"] = _card_license(_cached_hub_readme(info["base_model"]))
    return info


def _cached_hub_readme(repo_id: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(repo_id, "README.md")
    except ValueError:  # not a valid repo id
        return None
    return path if isinstance(path, str) else None


def _card_license(path: str | None) -> str | None:
    if not path or not os.path.isfile(path):
        return None
    try:
        return ModelCard.load(path, ignore_metadata_errors=True).data.license
    except Exception as error:  # a malformed card must not stop the run's own card
        logger.warning("Could not read the license from %s: %s", path, error)
        return None


# ---------------------------------------------------------------------------------------------- the card


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


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
    card_data = ModelCardData(
        base_model=info["base_model"],
        datasets=[dataset_name] if dataset_name else None,
        library_name="transformers",
        license=info["license"],
        model_name=model_name,
        pipeline_tag="text-generation",
        tags=["generated_from_trainer", *tags],
    )
    template = importlib.resources.files("triage_trl").joinpath("templates/model_card.md").read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
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
        triage_trl_version=__version__,
        **{f"{p}_version": _version(p if p != "pytorch" else "torch")
           for p in ("trl", "transformers", "pytorch", "datasets", "tokenizers")},
    )


# ---------------------------------------------------------------------------------------------- triage-eval results


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


def eval_results_from_json(results: dict) -> list[EvalResult]:
    """One ``EvalResult`` per benchmark and metric of a ``triage-eval`` ``results.json``.

    Args:
        results: the parsed file (``config``, ``metrics`` as fractions in [0, 1], ``records`` per benchmark).

    Returns:
        Entries with ``task_type="text-generation"``, the benchmark's Hub dataset (id, config, split) where
        ``triage_trl.eval`` knows it, ``metric_type`` like ``"pass@1"`` and ``metric_value`` in percent (two
        decimals); ``metric_name`` states sampling, precision, backend and problem count.

    Raises:
        ValueError: the file has no ``config`` or no ``metrics``.
    """
    from ..eval.benchmarks import HUB_SOURCES

    if not isinstance(results.get("config"), dict) or not isinstance(results.get("metrics"), dict):
        raise ValueError("This is not a triage-eval results.json (no `config` / `metrics`): pass the file that "
                         "`triage-eval --output-dir DIR` wrote as DIR/results.json.")
    config = results["config"]
    sampling = "greedy" if not config.get("temperature") else f"T={config['temperature']}, n={config.get('n')}"
    entries = []
    for bench, metrics in results["metrics"].items():
        dataset_id, dataset_config, split = HUB_SOURCES.get(bench, (bench, None, None))
        problems = len(results.get("records", {}).get(bench, []))
        for metric, value in metrics.items():
            entries.append(EvalResult(
                task_type="text-generation",
                dataset_type=dataset_id,
                dataset_name=bench,
                dataset_config=dataset_config,
                dataset_split=split,
                metric_type=metric,
                metric_value=round(100.0 * float(value), 2),
                metric_name=f"{metric} ({sampling}, {config.get('precision')} {config.get('backend')}, "
                            f"{problems} problems)",
            ))
    return entries


def eval_section(entries: list[EvalResult]) -> str:
    """Markdown table of ``entries`` between :data:`EVAL_SECTION_START` and :data:`EVAL_SECTION_END`."""
    lines = [EVAL_SECTION_START, "## Evaluation", "", "Measured with `triage-eval` (percent).", "",
             "| benchmark | metric | value |", "|---|---|---:|"]
    for e in entries:
        lines.append(md_row(md_cell(e.dataset_name), md_cell(e.metric_name or e.metric_type), md_cell(e.metric_value)))
    return "\n".join(lines + [EVAL_SECTION_END]) + "\n"


def add_eval_results_to_card(run_dir: str, results_json: str) -> ModelCard:
    """Put a ``triage-eval`` ``results.json`` into the run's card: ``model-index`` metadata and an Evaluation table.

    Entries for the same benchmark, metric and settings are replaced, others kept, so re-adding a file is a no-op.

    Args:
        run_dir: the training run's ``output_dir``, holding its ``README.md`` card.
        results_json: the ``results.json`` that ``triage-eval`` wrote.

    Returns:
        The updated card, already saved to ``run_dir/README.md``.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``README.md`` or ``results_json`` does not exist.
        ValueError: ``results_json`` is not a ``triage-eval`` results file.
    """
    card_path = os.path.join(run_dir, "README.md")
    for path, remedy in ((card_path, "train into it first (the trainer writes the card)"),
                         (results_json, "run `triage-eval --output-dir DIR` and pass DIR/results.json")):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist: {remedy}.")
    with open(results_json, encoding="utf-8") as f:
        new = eval_results_from_json(json.load(f))
    card = ModelCard.load(card_path)
    card.data.model_name = card.data.model_name or os.path.basename(os.path.normpath(run_dir))

    def key(e):
        return (e.dataset_type, e.dataset_config, e.dataset_split, e.metric_type, e.metric_name)

    replaced = {key(e) for e in new}
    card.data.eval_results = [e for e in (card.data.eval_results or []) if key(e) not in replaced] + new
    body = re.sub(re.escape(EVAL_SECTION_START) + r".*?" + re.escape(EVAL_SECTION_END) + r"\n?", "", card.text,
                  flags=re.S)
    anchor = "## Training procedure"
    section = eval_section(card.data.eval_results)
    body = body.replace(anchor, f"{section}\n{anchor}", 1) if anchor in body else body.rstrip("\n") + "\n\n" + section
    card.text = body
    card.save(card_path)
    return card
