"""NVFP4Config: every field parses from the command line (HfArgumentParser) with its help, and validation names
the field."""

import pytest

from triage_trl.nvfp4.config import NVFP4Config


def test_fields_parse_from_the_command_line_with_their_help():
    from transformers import HfArgumentParser

    parser = HfArgumentParser(NVFP4Config)
    text = parser.format_help()  # a stray "%" in a help string breaks argparse here
    for name in NVFP4Config.__dataclass_fields__:
        assert f"--{name}" in text
    (config,) = parser.parse_args_into_dataclasses(
        ["--nvfp4_recipe", "paper", "--nvfp4_four_over_six", "--no_nvfp4_weight_cache", "--nvfp4_keep_last_blocks", "2"]
    )
    assert (config.nvfp4_recipe, config.nvfp4_four_over_six, config.nvfp4_weight_cache) == ("paper", True, False)
    config.validate_nvfp4()
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--nvfp4_recipe", "most"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"nvfp4_recipe": "most"}, "nvfp4_recipe='most' is invalid"),
        ({"nvfp4_keep_first_blocks": -1}, "nvfp4_keep_first_blocks=-1 is out of range"),
        ({"nvfp4_exclude_patterns": "q_proj"}, "give a list of regular expressions"),
        ({"nvfp4_exclude_patterns": ["[q"]}, "not a valid regular expression"),
        ({"nvfp4_learner_scales": "sampler"}, "set sampler_precision='nvfp4'"),
    ],
)
def test_validation_names_the_field(overrides, match):
    config = NVFP4Config(**overrides)
    with pytest.raises(ValueError, match=match):
        config.validate_nvfp4()
    assert getattr(config, next(iter(overrides))) == next(iter(overrides.values()))  # never mutated
