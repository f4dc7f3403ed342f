"""The output folder of a run: checked before any model loads, and held by one run at a time.

* :func:`check_output_dir`: the folder (or its nearest existing parent) can be written, and its filesystem has room
  for a checkpoint of the model (:func:`checkpoint_bytes`), so a read-only or full disk fails in one line before the
  model loads instead of at the first save, after the steps are spent;
* :class:`RunLock`: ``<output_dir>/.triage-run.lock`` (``{"pid", "host"}``) taken with ``O_CREAT | O_EXCL``: a second
  live run on the same folder is refused; a lock left by a dead process on this host is taken over with a warning;
* :func:`existing_run`: what in a folder shows it already holds a run (``checkpoint-N/``, ``trainer_state.json``),
  so a new run is refused there unless it resumes.

Launch configurations: single process, DDP, FSDP2 and ZeRO. The lock is taken and released by the main process only
(``TrainingArguments.should_save``: process 0 of the run); every process may run the read-only checks.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = ".triage-run.lock"
"""The lock file a run holds in its output folder while it runs."""

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class OutputFolderError(ValueError):
    """The output folder cannot take this run: read-only, full, or held by another run. The message names the fix."""


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_write(folder: Path) -> None:
    """Create and remove a file in ``folder`` (``os.access`` says yes to root on a read-only mount)."""
    fd, name = tempfile.mkstemp(prefix=".triage-write-probe-", dir=folder)
    os.close(fd)
    os.unlink(name)


def model_bytes(model) -> int | None:
    """The size of ``model``'s weights in bytes: the weight files of a local folder (``*.safetensors``, ``*.bin``), or
    the parameters of an ``nn.Module``; ``None`` when unknown (a Hub id not in a local folder)."""
    if hasattr(model, "parameters"):
        return sum(p.numel() * p.element_size() for p in model.parameters())
    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        files = [f for f in Path(model).iterdir() if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES)]
        return sum(f.stat().st_size for f in files) or None
    return None


def checkpoint_bytes(weights: int, *, save_only_model: bool = False) -> int:
    """A lower bound on one checkpoint's size for weights of ``weights`` bytes: the weights, plus (unless
    ``save_only_model``) AdamW's two moments, at least the weights' size each (3x in all; float32 moments of bf16
    weights make it 5x)."""
    return weights if save_only_model else 3 * weights


def check_output_dir(output_dir: str | os.PathLike, *, needed_bytes: int | None = None) -> None:
    """Check that ``output_dir`` can be written and has ``needed_bytes`` free, before anything loads.

    The folder need not exist: its nearest existing parent is checked (the run creates it).

    Raises:
        OutputFolderError: the folder is a file, cannot be written (read-only filesystem, permissions), or its
            filesystem has less than ``needed_bytes`` free; one line naming the folder and the fix.
    """
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise OutputFolderError(f"output_dir {folder} is a file, not a folder: choose another --output_dir.")
    existing = _nearest_existing(folder)
    try:
        _probe_write(existing)
    except OSError as err:
        why = "is on a read-only filesystem" if err.errno == errno.EROFS else f"cannot be written ({err.strerror})"
        raise OutputFolderError(
            f"output_dir {folder} {why}: choose a writable --output_dir (or fix the folder's permissions)."
        ) from None
    if needed_bytes:
        free = shutil.disk_usage(existing).free
        if free < needed_bytes:
            raise OutputFolderError(
                f"output_dir {folder} has {free / 2**30:.2f} GiB free, less than one checkpoint of this model needs "
                f"(at least {needed_bytes / 2**30:.2f} GiB): free space there or choose an --output_dir on a larger "
                "disk (save_only_model=True needs a third of it)."
            )


def existing_run(output_dir: str | os.PathLike) -> list[str]:
    """What in ``output_dir`` shows a run was already written there: ``checkpoint-N`` folders and
    ``trainer_state.json`` (sorted names; ``[]`` for a new or missing folder)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if (p.is_dir() and _CHECKPOINT_RE.match(p.name)) or p.name == "trainer_state.json")


def refuse_existing_run(output_dir: str | os.PathLike, resume_from_checkpoint) -> None:
    """Refuse a new run (not resuming) into a folder that already holds one.

    Raises:
        OutputFolderError: ``output_dir`` holds checkpoints or a ``trainer_state.json`` and ``resume_from_checkpoint``
            is not set.
    """
    if resume_from_checkpoint:
        return
    found = existing_run(output_dir)
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise OutputFolderError(
            f"output_dir {output_dir} already holds a run ({shown}): resume it with --resume_from_checkpoint true, "
            "or choose a new --output_dir (a second run there would mix its weights with the first's checkpoints)."
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class RunLock:
    """``<output_dir>/.triage-run.lock``, held while a run writes into ``output_dir``.

    :meth:`acquire` creates it atomically. A lock of a live process on this host (other than this one) is refused; a
    lock of a dead process (killed, crashed) is taken over with a warning; a lock of this same process (a notebook
    building a second trainer) is kept. A lock written from another host is refused (its process cannot be checked
    from here): delete the file once that run is over. :meth:`release` removes the file if this process holds it.
    """

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_NAME
        self.held = False

    def _owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def check(self) -> None:
        """Refuse, as :meth:`acquire` would, when another live run holds the lock; takes nothing.

        Raises:
            OutputFolderError: another live run holds the lock.
        """
        owner = self._owner() if self.path.exists() else None
        if not owner:
            return
        pid, host = owner.get("pid"), owner.get("host")
        if pid == os.getpid() or not isinstance(pid, int):
            return
        if host != socket.gethostname() or _pid_alive(pid):
            raise OutputFolderError(
                f"output_dir {self.path.parent} is in use by run PID {pid} on {host} ({self.path}): choose another "
                f"--output_dir, or wait for that run to end (delete the lock file only if it is not running)."
            )

    def acquire(self) -> RunLock:
        """Take the lock.

        Raises:
            OutputFolderError: another live run holds it (names its PID and the fix).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner() or {}
                pid, host = owner.get("pid"), owner.get("host")
                if pid == me["pid"] and host == me["host"]:
                    self.held = True
                    return self
                if host == me["host"] and isinstance(pid, int) and not _pid_alive(pid):
                    logger.warning("output_dir %s: taking over the lock of run PID %d, which is no longer running.",
                                   self.path.parent, pid)
                    self.path.unlink(missing_ok=True)
                    continue
                if not owner:  # being written by a run that started this instant, or garbage
                    raise OutputFolderError(
                        f"output_dir {self.path.parent} is locked by another run ({self.path} unreadable): choose "
                        f"another --output_dir, or delete {self.path} if no run uses the folder."
                    )
                raise OutputFolderError(
                    f"output_dir {self.path.parent} is in use by run PID {pid} on {host} ({self.path}): choose another "
                    f"--output_dir, or wait for that run to end (delete the lock file only if it is not running)."
                )
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise OutputFolderError(f"output_dir {self.path.parent}: could not take {self.path}; delete it and retry.")

    def release(self) -> None:
        """Remove the lock file if this process holds it (idempotent)."""
        if self.held:
            owner = self._owner()
            if owner and owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


__all__ = ["LOCK_NAME", "OutputFolderError", "RunLock", "check_output_dir", "checkpoint_bytes", "existing_run",
           "model_bytes", "refuse_existing_run"]
