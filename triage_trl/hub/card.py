"""What every model card of triage-trl shares: the citations, markdown table cells, the base model and license found
without network, the Hub metadata every card carries, and rendering a template of ``triage_trl/templates``.

Three cards use it: a training run's card (``triage_trl/trainer/model_card.py``), an NVFP4 export's card
(``triage_trl/export/card.py``) and the ``triage-eval --to-card`` results added to a run's card
(``triage_trl/eval/card.py``). Built with ``huggingface_hub``'s ``ModelCard`` API, as TRL's ``generate_model_card``.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import re
import textwrap
from importlib.metadata import PackageNotFoundError, version

from huggingface_hub import ModelCard, ModelCardData

from .. import __version__
from ..models import read_model_source

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


def base_model_info(model_name_or_path: str | None) -> dict:
    """The Hub base model of a run and its license, found without network.

    A Hub id is its own base model; a local folder names one through its :data:`~triage_trl.models.SOURCE_FILE`
    marker (written for the embedded SmolLM2). The license comes from the marker, else from the base model's card
    in the local Hub cache, else from a ``README.md`` card inside the local folder.

    Returns:
        ``{"base_model": str | None, "license": str | None, "note": str}``.
    """
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


def package_version(package: str) -> str:
    """``package``'s installed version, or ``"not installed"``."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def card_data(*, base_model: str | None, license: str | None, datasets: list[str] | None, model_name: str,
              tags: list[str], base_model_relation: str | None = None) -> ModelCardData:
    """The Hub metadata of a triage-trl card: a transformers text-generation model with these values."""
    return ModelCardData(base_model=base_model, base_model_relation=base_model_relation, datasets=datasets,
                         library_name="transformers", license=license, model_name=model_name,
                         pipeline_tag="text-generation", tags=tags)


def render_card(template: str, data: ModelCardData, **values) -> ModelCard:
    """``triage_trl/templates/<template>`` rendered with ``data`` and ``values`` (``triage_trl_version`` added).

    Raises:
        FileNotFoundError: no such template in the installed package.
    """
    text = importlib.resources.files("triage_trl").joinpath(f"templates/{template}").read_text(encoding="utf-8")
    return ModelCard.from_template(data, template_str=text, triage_trl_version=__version__, **values)
