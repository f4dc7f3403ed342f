"""One set of field checks for both settings dataclasses (``triage_trl/runtime/validators.py``): a ``bool`` is never
a valid choice or count, in ``TriageConfig`` and ``NVFP4Config`` alike."""

import pytest

from triage_trl import TriageConfig
from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.runtime.validators import check_choice, check_in_range, check_integer_at_least


def test_bools_are_neither_choices_nor_integers_nor_numbers():
    check_choice("mode", 1, (1, -1))
    with pytest.raises(ValueError, match=r"mode=True is invalid: it must be one of 1, -1\."):
        check_choice("mode", True, (1, -1))  # True == 1, still refused
    check_integer_at_least("n", 1, 1)
    with pytest.raises(ValueError, match=r"n=True is out of range: it must be an integer >= 1\."):
        check_integer_at_least("n", True, 1)
    check_in_range("p", 1, 0.0, 1.0, "in [0, 1]")
    with pytest.raises(ValueError, match=r"p=True is out of range: it must be in \[0, 1\]\."):
        check_in_range("p", True, 0.0, 1.0, "in [0, 1]")


@pytest.mark.parametrize("field", ["triage_mode", "triage_segment_mode", "triage_direction"])
def test_triage_config_refuses_a_bool_choice(field):
    with pytest.raises(ValueError, match=f"{field}=True is invalid"):
        TriageConfig(**{field: True})


@pytest.mark.parametrize("field", ["nvfp4_recipe", "learner_precision", "nvfp4_moe_experts"])
def test_nvfp4_config_refuses_a_bool_choice(field):
    config = NVFP4Config(**{field: True})
    with pytest.raises(ValueError, match=f"{field}=True is invalid"):
        config.validate_nvfp4()
    with pytest.raises(ValueError, match="nvfp4_calibration_prompts=True is out of range"):
        NVFP4Config(nvfp4_calibration_prompts=True).validate_nvfp4()
