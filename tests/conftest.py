"""Shared pytest fixtures. Each owner keeps its fixtures in its own commented block."""

import pytest


# --- trainer fixtures ---
@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 (2 blocks, hidden 128, NVFP4-friendly shapes) and its tokenizer, saved once per session."""
    from triage_trl.testing import save_tiny_qwen3

    return str(save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-trainer")))
# --- end trainer fixtures ---
