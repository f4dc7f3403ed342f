"""Checkpoints that a kill at any moment cannot leave half-written, and a resume that skips incomplete ones.

Writing: :func:`atomic_checkpoint` wraps transformers' ``Trainer._save_checkpoint`` (the seam, listed in
``tests/test_trl_contract.py``). Every file of ``checkpoint-N`` (model, optimizer, scheduler, RNG states, trainer
state, TRL's extras) is written into ``<run_dir>/.partial-checkpoint-N/checkpoint-N``; once every process has
written its part, the main process renames it to ``<run_dir>/checkpoint-N`` (one ``rename``: atomic on a POSIX
filesystem) and then applies ``save_total_limit``. A kill before the rename leaves the previous checkpoints and a
hidden ``.partial-checkpoint-N`` folder, which transformers' ``get_last_checkpoint`` never picks and the next save or
resume deletes; a kill after it leaves the new complete checkpoint.

Reading: :func:`resolve_resume` turns ``resume_from_checkpoint`` (``True``, a ``checkpoint-N`` path, or a run folder)
into the last *complete* checkpoint (one with ``trainer_state.json``, the last file written), warning about each
incomplete ``checkpoint-N`` it skips (e.g. left by a run killed while saving with an older triage-trl or with
transformers' own ``Trainer``).

Launch configurations: single process, DDP, FSDP2 and ZeRO (every process writes its shards into the same staging
folder; the rename, the clean-up and the rotation are done by the main process only, between two barriers). With
``save_on_each_node`` each node's main process renames its own copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME, written last in a checkpoint
PARTIAL_PREFIX = ".partial-"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def is_complete(checkpoint: str | os.PathLike) -> bool:
    """A ``checkpoint-N`` folder transformers can resume from: it holds ``trainer_state.json``."""
    return os.path.isfile(os.path.join(checkpoint, TRAINER_STATE))


def checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of ``folder``, by increasing ``N`` (``[]`` when there is none)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT_RE.match(p.name).group(1)))


def last_complete_checkpoint(folder: str | os.PathLike, *, before: int | None = None) -> str | None:
    """The complete ``checkpoint-N`` of ``folder`` with the largest ``N`` (below ``before`` when given), warning about
    every incomplete one above it; ``None`` when there is none."""
    for path in reversed(checkpoints(folder)):
        step = int(_CHECKPOINT_RE.match(path.name).group(1))
        if before is not None and step >= before:
            continue
        if is_complete(path):
            return str(path)
        logger.warning("Skipping %s: it has no %s (its save was interrupted); delete it when convenient.",
                       path, TRAINER_STATE)
    return None


def resolve_resume(resume_from_checkpoint, output_dir: str | os.PathLike):
    """The complete checkpoint to resume from, for ``Trainer.train(resume_from_checkpoint=...)``.

    * ``None``/``False``: ``None`` (a new run);
    * ``True`` (or the strings ``"true"``/``"True"``): the last complete checkpoint of ``output_dir``;
    * a run folder (holds ``checkpoint-N`` folders): its last complete checkpoint;
    * a ``checkpoint-N`` path: itself when complete, else (with a warning) the last complete checkpoint before it.

    Raises:
        ValueError: no complete checkpoint is found (names the folder and the fix).
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True or str(resume_from_checkpoint).lower() == "true":
        found = last_complete_checkpoint(output_dir)
        if found is None:
            raise ValueError(f"No complete checkpoint (a checkpoint-N folder with {TRAINER_STATE}) in {output_dir}: "
                             "start a new run without --resume_from_checkpoint, or give the run folder it was "
                             "saved to.")
        return found
    path = Path(resume_from_checkpoint)
    match = _CHECKPOINT_RE.match(path.name)
    if match is None and path.is_dir() and not is_complete(path) and checkpoints(path):
        found = last_complete_checkpoint(path)
    elif match is not None and not is_complete(path):
        logger.warning("%s is incomplete (no %s: its save was interrupted); resuming from the last complete "
                       "checkpoint before it.", path, TRAINER_STATE)
        found = last_complete_checkpoint(path.parent, before=int(match.group(1)))
    else:
        return str(resume_from_checkpoint)
    if found is None:
        raise ValueError(f"No complete checkpoint for resume_from_checkpoint={resume_from_checkpoint}: none of the "
                         f"checkpoint-N folders there has {TRAINER_STATE}. Start a new run in another output_dir.")
    return found


def remove_partials(run_dir: str | os.PathLike) -> None:
    """Delete the ``.partial-checkpoint-N`` folders an interrupted save left in ``run_dir``."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        for path in run_dir.iterdir():
            if path.name.startswith(PARTIAL_PREFIX + "checkpoint-") and path.is_dir():
                logger.warning("Removing %s, left by a checkpoint save that was interrupted.", path)
                shutil.rmtree(path, ignore_errors=True)


def _publish(staged: Path, final: Path) -> None:
    """Rename ``staged`` to ``final``; an existing ``final`` (the same step saved again) is moved aside first and
    deleted after, so a complete ``checkpoint-N`` is on disk at every moment but one rename."""
    old = None
    if final.exists():
        old = final.parent / f"{PARTIAL_PREFIX}replaced-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staged, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_checkpoint(trainer, trial=None):
    """Within the block, ``trainer._get_output_dir`` names a staging folder, so ``Trainer._save_checkpoint`` writes
    ``checkpoint-N`` there; on success the main process renames it into the run folder and rotates checkpoints.
    On an error the staging folder is removed and the error re-raised (the previous checkpoints are untouched)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    run_dir = Path(trainer._get_output_dir(trial=trial))
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staging_root = run_dir / f"{PARTIAL_PREFIX}{name}"
    main = trainer.args.should_save
    if main:
        remove_partials(run_dir)
        staging_root.mkdir(parents=True, exist_ok=True)
    trainer.accelerator.wait_for_everyone()
    limit = trainer.args.save_total_limit
    trainer._get_output_dir = lambda trial=None: str(staging_root)
    trainer.args.save_total_limit = None  # rotation runs on the run folder, after the rename
    try:
        yield staging_root / name
    except BaseException:
        if main:
            shutil.rmtree(staging_root, ignore_errors=True)
        raise
    finally:
        del trainer._get_output_dir
        trainer.args.save_total_limit = limit
    trainer.accelerator.wait_for_everyone()
    final = run_dir / name
    if main:
        _publish(staging_root / name, final)
        shutil.rmtree(staging_root, ignore_errors=True)
    best = trainer.state.best_model_checkpoint
    if best and Path(best).parent == staging_root:
        trainer.state.best_model_checkpoint = str(run_dir / Path(best).name)
    if main:
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
    trainer.accelerator.wait_for_everyone()


__all__ = ["PARTIAL_PREFIX", "atomic_checkpoint", "checkpoints", "is_complete", "last_complete_checkpoint",
           "remove_partials", "resolve_resume"]
