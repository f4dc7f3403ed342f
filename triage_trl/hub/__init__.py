"""The Hugging Face Hub side of triage-trl: ``card.py``, what the run's, the export's and ``triage-eval``'s model cards
share (citations, table cells, base model and license, Hub metadata, templates)."""
