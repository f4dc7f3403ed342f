"""``triage-trl env``: the environment as text to paste in a bug report, like ``trl env`` and ``accelerate env``
(:func:`triage_trl.provenance.environment_info`: versions, the vLLM platform, the NVFP4 learner path, the CPU's bf16
support).
"""

from __future__ import annotations

from .provenance import PACKAGES, environment_info, package_version  # noqa: F401  (this command's public names)


def format_report(info: dict[str, str]) -> str:
    """The report as ``trl env`` prints it: a header line, then ``- label: value`` lines."""
    lines = "\n".join(f"- {label}: {value}" for label, value in info.items())
    return f"Copy-paste the following information when reporting an issue:\n\n{lines}\n"


def main(argv: list[str] | None = None) -> int:
    """``triage-trl env``: print the report; returns the exit status (0)."""
    import argparse

    argparse.ArgumentParser(prog="triage-trl env", description=__doc__.splitlines()[0]).parse_args(argv)
    print(format_report(environment_info()))
    return 0
