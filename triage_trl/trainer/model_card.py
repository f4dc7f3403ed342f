"""The TRIAGE parts of the model card that TRL's card machinery writes.

TRL's ``_BaseTrainer.create_model_card`` renders ``trl/templates/lm_model_card.md`` with the trainer's
``_tag_names``, ``_name`` and ``_paper``; :class:`TriageGRPOTrainer` sets those to TRIAGE's and inserts the section
built here (settings, kernels, mismatch first vs last steps) before the card's "Framework versions".
"""

from __future__ import annotations

import math
import textwrap

TRIAGE_PAPER = {
    "title": "TRIAGE: Direction-Aware Mismatch Stabilization of Native NVFP4 Reinforcement Learning",
    "id": "2610.07043",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @article{triage2026nvfp4,
            title        = {{TRIAGE: Direction-Aware Mismatch Stabilization of Native NVFP4 Reinforcement Learning}},
            year         = 2026,
            eprint       = {arXiv:2610.07043},
        }

        @article{shao2024deepseekmath,
            title        = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
            author       = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},
            year         = 2024,
            eprint       = {arXiv:2402.03300},
        }"""),
}

RECONSTRUCTION_NOTE = (
    "The TRIAGE objective used here is reconstructed from the abstract of arXiv 2610.07043 (the only public part of "
    "the paper): every choice it makes is a named `triage_*` setting listed below, and it may differ from the "
    "authors' implementation."
)

# Mismatch metrics summarised first vs last step (names under `triage/`).
SUMMARY_METRICS = ("gap_abs_mean", "k3_kl", "amp_imbalance", "hot_segment_frac", "repaired_frac", "weight_mean")


def mismatch_summary(history: list[dict]) -> tuple[dict, dict] | None:
    """Mean of each :data:`SUMMARY_METRICS` entry over the first and over the last recorded optimizer step.

    Args:
        history: records ``{"step": int, <metric>: float, ...}``, one per loss computation, in order.

    Returns:
        ``(first, last)`` dicts with a ``"step"`` key, or ``None`` when ``history`` is empty.
    """
    if not history:
        return None

    def at(step):
        rows = [r for r in history if r["step"] == step]
        out = {"step": step}
        for name in SUMMARY_METRICS:
            values = [r[name] for r in rows if name in r and math.isfinite(r[name])]
            out[name] = sum(values) / len(values) if values else float("nan")
        return out

    return at(history[0]["step"]), at(history[-1]["step"])


def triage_card_section(
    *,
    triage_settings: dict,
    nvfp4_settings: dict,
    kernels: dict,
    history: list[dict],
    sync_probe_gaps: list[float],
) -> str:
    """Markdown of the card's TRIAGE section.

    Args:
        triage_settings: ``TriageConfig.triage_settings()``.
        nvfp4_settings: ``TriageGRPOConfig.nvfp4_settings()``.
        kernels: which kernels/paths ran, e.g. ``{"sampler": "...", "learner": "..."}`` (strings).
        history: per-loss-call metric records (see :func:`mismatch_summary`).
        sync_probe_gaps: ``triage/sync_probe_gap`` values measured after each weight sync (nats).
    """
    lines = ["## TRIAGE", "", RECONSTRUCTION_NOTE, "", "### Settings", "", "| setting | value |", "|---|---|"]
    for name, value in {**triage_settings, **nvfp4_settings}.items():
        lines.append(f"| `{name}` | `{value}` |")
    lines += ["", "### Kernels that ran", ""]
    if kernels:
        lines += [f"- **{part}**: {desc}" for part, desc in kernels.items()]
    else:
        lines.append("- (no report: the run used no vLLM sampler and no NVFP4 learner)")
    lines += ["", "### Mismatch (learner minus sampler log-probs, nats), first vs last step", ""]
    summary = mismatch_summary(history)
    if summary is None:
        lines.append("No TRIAGE metrics were recorded (triage_mode='off' or no training step).")
    else:
        first, last = summary
        lines += [f"| metric | step {first['step']} | step {last['step']} |", "|---|---|---|"]
        for name in SUMMARY_METRICS:
            lines.append(f"| `triage/{name}` | {first[name]:.4g} | {last[name]:.4g} |")
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


def insert_section(card_text: str, section: str) -> str:
    """Insert ``section`` before the card's "### Framework versions" heading (or append it)."""
    anchor = "### Framework versions"
    if anchor in card_text:
        head, tail = card_text.split(anchor, 1)
        return f"{head}{section}\n{anchor}{tail}"
    return card_text.rstrip("\n") + "\n\n" + section
