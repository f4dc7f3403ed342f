"""``python -m triage_trl --config recipes/<recipe>.yaml``: see :mod:`triage_trl.cli`."""

from .cli import main

if __name__ == "__main__":
    main()
