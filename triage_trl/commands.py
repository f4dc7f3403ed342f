"""``triage-trl``: one command for the project's tools, like ``trl``: ``triage-trl grpo|eval|report|export|env ...``.

Each subcommand is the same program as its own console script (``triage-grpo``, ``triage-eval``, ``triage-report``,
``triage-export``);
``env`` prints the environment report (:mod:`triage_trl.env_report`). Every entry point here returns an exit status.
"""

from __future__ import annotations

import importlib
import sys

from . import __version__

SUBCOMMANDS = {
    "grpo": ("triage_trl.cli", "train with TRIAGE-GRPO (= triage-grpo)"),
    "eval": ("triage_trl.eval.cli", "score a model on math benchmarks (= triage-eval)"),
    "report": ("triage_trl.report", "plot a run's TRIAGE metrics (= triage-report)"),
    "export": ("triage_trl.export.cli", "write a run's weights as an NVFP4 checkpoint vLLM serves (= triage-export)"),
    "env": ("triage_trl.env_report", "print versions, vLLM platform and NVFP4 paths for a bug report"),
}

USAGE = "usage: triage-trl [-h] [--version] {" + ",".join(SUBCOMMANDS) + "} ...\n"


def main(argv: list[str] | None = None) -> int:
    """Run ``triage-trl SUBCOMMAND ARGS...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        lines = "\n".join(f"  {name:<8}{text}" for name, (_, text) in SUBCOMMANDS.items())
        print(f"{USAGE}\nTRIAGE for TRL, torchao NVFP4 and vLLM.\n\nsubcommands:\n{lines}\n\n"
              "`triage-trl SUBCOMMAND --help` describes each one.")
        return 0
    if argv[0] == "--version":
        print(f"triage-trl {__version__}")
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"{USAGE}triage-trl: error: unknown subcommand {argv[0]!r} (choose from {', '.join(SUBCOMMANDS)})",
              file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return exit_status(module.main(argv[1:]))


def report_main(argv: list[str] | None = None) -> int:
    """The ``triage-report`` console script: :func:`triage_trl.report.main` (which returns the plot paths) as an
    exit status."""
    from .report import main as report

    return exit_status(report(argv))


def exit_status(result) -> int:
    """An entry point's result as an exit status: an int as it is, anything else (paths, a trainer) 0."""
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
