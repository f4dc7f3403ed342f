"""``python -m triage_trl --config <recipe>``: the ``triage-grpo`` command (see :mod:`triage_trl.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
