"""What a run computed with: ``environment.py`` (library versions, the vLLM platform, the NVFP4 learner path, the
CPU's bf16 support: what ``triage-trl env`` prints) and ``revision.py`` (the triage-trl version and the git commit of
the checkout it runs from). The stability lab records both per start of a run; ``triage_run.json`` the commit."""

from .environment import PACKAGES, environment_info, package_version
from .revision import CODE_PATHS, code_revision, git_revision, short_revision

__all__ = ["CODE_PATHS", "PACKAGES", "code_revision", "environment_info", "git_revision", "package_version",
           "short_revision"]
