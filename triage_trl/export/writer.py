"""``export_run``: a run's weights as a sharded compressed-tensors NVFP4 checkpoint that ``vllm serve`` loads.

The checkpoint is the one the run's sampler serves, written by the same code: the run's NVFP4 layer selection
(``triage_trl.nvfp4.selection``), activation scales from ``calibrate_input_global_scales`` on the prompts the
sampler calibrated on, tensors from ``iter_nvfp4_checkpoint_weights`` cast as the engine stores them, and the
sampler's checkpoint writer (``sampler.vllm_engine.write_engine_checkpoint``: config with the compressed-tensors
quantisation config, dtype bf16, tokenizer). Only the weights are laid out differently: in safetensors shards with
an index (``huggingface_hub.save_torch_state_dict``), plus the generation config and a card.

Everything is written into a temporary folder next to the output (``.<name>.partial-<pid>-*``) and renamed into
place at the end, so a failed export leaves nothing behind and a finished one is complete. A partial folder left by a
killed export (its process is gone) is deleted by the next export to the same output; ``triage-export`` turns
SIGTERM into an ordinary exit, which deletes its own.

The output is never a training run: ``--output`` (with or without ``--overwrite``) is refused when it is a run folder
(``triage_run.json``, ``trainer_state.json``, ``training_args.bin`` or a ``checkpoint-N`` folder in it), holds one at
any depth, or contains the run being exported, so an export cannot replace or delete a run.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .card import export_card
from .run_record import BUILTIN_CALIBRATION_PROMPTS
from .source import ExportSource, find_export_source

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_run` wrote: the folder, the source, the NVFP4 / bf16 layer counts, where the activation
    scales came from (``"run"`` or ``"built-in"``) and the Hub URL when pushed."""

    output_dir: Path
    source: ExportSource
    nvfp4_layers: int
    bf16_layers: int
    calibration: str
    hub_url: str | None = None


RUN_MARKERS = ("triage_run.json", "trainer_state.json", "training_args.bin")
"""Files that make a folder a training run's output folder (with ``checkpoint-N`` subfolders)."""


def is_run_folder(folder: Path) -> bool:
    """Is ``folder`` a training run's output folder (or a checkpoint of one)?"""
    if any((folder / m).is_file() for m in RUN_MARKERS):
        return True
    return any(p.is_dir() and p.name.startswith("checkpoint-") and p.name[11:].isdigit() for p in folder.iterdir())


def _run_inside(folder: Path, max_depth: int = 4) -> Path | None:
    """The first run folder at or below ``folder`` (``max_depth`` levels down), else ``None``."""
    for root, dirs, _ in os.walk(folder):
        here = Path(root)
        if is_run_folder(here):
            return here
        if len(here.relative_to(folder).parts) >= max_depth:
            dirs.clear()
    return None


def check_output_dir(output_dir: str | os.PathLike, *, overwrite: bool = False,
                     run_dir: str | os.PathLike | None = None) -> Path:
    """The output folder, refused when it exists with files in it and ``overwrite`` is off, and always when it is, holds
    or contains a training run (``run_dir`` included).

    Raises:
        FileExistsError: ``output_dir`` is a file; a folder with files and ``overwrite`` is off; a run folder, a folder
            holding one, or the run's own folder or one above it.
    """
    out = Path(output_dir)
    remedy = (f"choose an --output outside it, e.g. {out.resolve().name}-nvfp4 next to it; --overwrite only replaces "
              "an earlier export")
    if run_dir is not None:
        run = Path(run_dir).resolve()
        if out.resolve() == run or out.resolve() in run.parents:
            raise FileExistsError(f"--output {out} is the run folder {run_dir} or holds it, and would replace it: "
                                  f"{remedy}.")
    if out.is_dir():
        inside = _run_inside(out)
        if inside is not None:
            what = "is a training run's folder" if inside == out else f"holds a training run ({inside})"
            raise FileExistsError(f"--output {out} {what}, which an export never replaces: {remedy}.")
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not overwrite):
        raise FileExistsError(f"{out} already exists: choose a new --output folder, or pass --overwrite to replace it.")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete the ``.<name>.partial-<pid>-*`` / ``.<name>.old-<pid>-*`` folders next to ``out`` whose export process is
    no longer running (killed during an export). Returns what was deleted."""
    removed = []
    if not out.parent.is_dir():
        return removed
    for path in out.parent.iterdir():
        for kind in (".partial-", ".old-"):
            prefix = f".{out.name}{kind}"
            if path.name.startswith(prefix) and path.is_dir():
                pid = path.name[len(prefix):].split("-", 1)[0]
                if not pid.isdigit() or not _pid_alive(int(pid)):
                    logger.warning("Removing %s, left by an export that was interrupted.", path)
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
    return removed


def export_run(
    run_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    checkpoint: str | None = None,
    push_to_hub: str | None = None,
    base_model: str | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    private: bool | None = None,
) -> ExportResult:
    """Export a training run's weights (final, or ``checkpoint``) as an NVFP4 checkpoint folder.

    Args:
        run_dir: the run's ``output_dir``.
        output_dir: the folder to write (must not hold files unless ``overwrite``).
        checkpoint: ``"checkpoint-N"`` inside ``run_dir``; ``None``: the final weights.
        push_to_hub: a Hub repo id to upload the folder to (created if missing).
        base_model: the card's ``base_model`` instead of the run's (e.g. the Hub repo of the trained run).
        overwrite: replace an existing ``output_dir``.
        max_shard_size: safetensors shard size (``huggingface_hub.save_torch_state_dict``).
        private: visibility of a repo created by ``push_to_hub``.

    Returns:
        An :class:`ExportResult`.

    Raises:
        FileNotFoundError, ValueError: a bad run folder or checkpoint (:func:`find_export_source`).
        FileExistsError: ``output_dir`` holds files and ``overwrite`` is off; it is, holds or contains a training
            run (never replaced, with or without ``overwrite``).
        KeyError, ValueError: the weights cannot be quantised (NaN or inf, naming the layer).
    """
    source = find_export_source(run_dir, checkpoint)
    out = check_output_dir(output_dir, overwrite=overwrite, run_dir=run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    try:
        result = _write(source, tmp, out, push_to_hub, base_model, max_shard_size)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if push_to_hub:
        result = ExportResult(**{**result.__dict__, "hub_url": _push(out, push_to_hub, source, private)})
    return result


def _write(source: ExportSource, tmp: Path, out: Path, repo_id, base_model, max_shard_size) -> ExportResult:
    from huggingface_hub import save_torch_state_dict

    from ..nvfp4.calibration import calibrate_input_global_scales
    from ..nvfp4.checkpoint_tensors import iter_nvfp4_checkpoint_weights, nvfp4_quantization_config
    from ..nvfp4.selection import nvfp4_layer_selection
    from ..sampler.vllm_engine import sampler_tensors, write_engine_checkpoint

    model, tokenizer = load_weights(source)
    selection = nvfp4_layer_selection(model, _nvfp4_config(source.record))
    prompts, calibration, kind = calibration_prompts(source, tokenizer)
    logger.info("Calibrating the activation scales of %d NVFP4 layers on %d prompts (%s).",
                len(selection.nvfp4_layers), len(prompts), kind)
    with torch.no_grad():
        scales = calibrate_input_global_scales(model, tokenizer, prompts, selection=selection)
        state = {name: t.detach().to("cpu").contiguous().clone() for name, t in
                 sampler_tensors(iter_nvfp4_checkpoint_weights(model, scales, selection=selection))}
    write_engine_checkpoint(tmp, "nvfp4", (), model.config, tokenizer,
                            nvfp4_quantization_config(model, selection=selection))
    save_torch_state_dict(state, tmp, max_shard_size=max_shard_size, metadata={"format": "pt"})  # replaces the
    # sampler writer's empty model.safetensors by the shards and their index
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    card = export_card(source, model_name=(repo_id or str(out)).rstrip("/").split("/")[-1],
                       serve_path=repo_id or str(out), selection=selection,
                       nvfp4_settings={k: v for k, v in selection.settings}, calibration=calibration,
                       base_model=base_model)
    card.save(tmp / "README.md")
    return ExportResult(out, source, len(selection.nvfp4_layers), len(selection.kept_layers), kind)


def load_weights(source: ExportSource):
    """``(model, tokenizer)`` of the source on CPU, in the dtype it was saved in (PEFT adapters merged into their
    base model); the tokenizer from the weights folder, else from the run folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.is_adapter:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(source.weights_dir, dtype="auto").merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype="auto")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.weights_dir)
    except (OSError, ValueError):
        tokenizer = AutoTokenizer.from_pretrained(source.run_dir)
    return model.eval(), tokenizer


def calibration_prompts(source: ExportSource, tokenizer) -> tuple[list[str], str, str]:
    """``(prompts, sentence for the card, "run" | "built-in")``: the run's recorded calibration prompts, else
    :data:`BUILTIN_CALIBRATION_PROMPTS` as user turns of the tokenizer's chat template (as text without one)."""
    recorded = (source.record or {}).get("calibration_prompts") or []
    if recorded:
        return list(recorded), (f"calibrated on the run's {len(recorded)} calibration prompts (the first training "
                                "prompts, as its sampler calibrated)"), "run"
    if getattr(tokenizer, "chat_template", None):
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in BUILTIN_CALIBRATION_PROMPTS]
    else:
        prompts = list(BUILTIN_CALIBRATION_PROMPTS)
    why = "the run folder records no prompts" if source.record is None else "the run recorded no prompts"
    logger.warning("Calibrating on triage-trl's %d built-in prompts: %s.", len(prompts), why)
    return prompts, f"calibrated on triage-trl's {len(prompts)} built-in prompts ({why})", "built-in"


def _nvfp4_config(record: dict | None):
    from ..nvfp4.config import NVFP4Config

    known = {f.name for f in fields(NVFP4Config)}
    return NVFP4Config(**{k: v for k, v in ((record or {}).get("nvfp4") or {}).items() if k in known})


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` (empty, or replaced) is removed only after."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _push(out: Path, repo_id: str, source: ExportSource, private: bool | None) -> str:
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True, private=private)
    what = source.checkpoint or "final weights"
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(out), repo_type="model",
                               commit_message=f"NVFP4 export of {source.run_dir.resolve().name} ({what})")
    return getattr(commit, "commit_url", None) or str(commit)
