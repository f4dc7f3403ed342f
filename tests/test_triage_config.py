"""TriageConfig: the spec's defaults and validation errors that name field, value and range."""

import dataclasses
import math

import pytest
from transformers import HfArgumentParser

from triage_trl import TriageConfig


def test_defaults_are_the_specs():
    c = TriageConfig()
    assert (c.triage_mode, c.triage_gap_sign, c.triage_segment_mode) == ("full", 1, "newline")
    assert (c.triage_tail_quantile, c.triage_tail_min_gap) == (0.98, 0.05)
    assert (c.triage_segment_max_tokens, c.triage_hot_min_tokens, c.triage_hot_density) == (64, 2, 0.10)
    assert (c.triage_rebalance_floor, c.triage_rebalance_scope) == (0.25, "segment")
    assert (c.triage_repair_mode, c.triage_severe_gap, c.triage_repair_clip) == ("excess_is", math.log(2), 2.0)
    assert c.triage_nonfinite_max_frac == 0.01


def test_every_field_has_help():
    for f in dataclasses.fields(TriageConfig):
        assert f.name.startswith("triage_") and f.metadata.get("help"), f.name


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("triage_mode", "on", "one of 'full', 'diagnose', 'off'"),
        ("triage_segment_mode", "tokens", "one of 'newline', 'fixed'"),
        ("triage_rebalance_scope", "all", "one of 'segment', 'tail'"),
        ("triage_repair_mode", "clip", "one of 'excess_is', 'mask', 'none'"),
        ("triage_gap_sign", 0, "1 or -1"),
        ("triage_tail_quantile", 1.0, "in (0, 1)"),
        ("triage_tail_quantile", 0.0, "in (0, 1)"),
        ("triage_tail_quantile", math.nan, "in (0, 1)"),
        ("triage_tail_min_gap", -0.1, ">= 0"),
        ("triage_segment_max_tokens", 0, "integer >= 1"),
        ("triage_segment_max_tokens", 2.5, "integer >= 1"),
        ("triage_hot_min_tokens", 0, "integer >= 1"),
        ("triage_hot_density", 1.5, "in [0, 1]"),
        ("triage_rebalance_floor", 0.0, "in (0, 1]"),
        ("triage_rebalance_floor", 1.01, "in (0, 1]"),
        ("triage_severe_gap", 0.0, "> 0"),
        ("triage_repair_clip", 0.5, ">= 1"),
        ("triage_repair_clip", math.inf, ">= 1"),
        ("triage_nonfinite_max_frac", -0.01, "in [0, 1]"),
        ("triage_nonfinite_max_frac", 1.5, "in [0, 1]"),
        ("triage_nonfinite_max_frac", math.nan, "in [0, 1]"),
        ("triage_nonfinite_max_frac", True, "in [0, 1]"),
    ],
)
def test_bad_values_raise_naming_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as err:
        TriageConfig(**{field: value})
    message = str(err.value)
    assert message.startswith(f"{field}={value!r}") and allowed in message


def test_triage_settings_lists_all_fields():
    assert set(TriageConfig().triage_settings()) == {f.name for f in dataclasses.fields(TriageConfig)}


def test_validation_changes_nothing():
    c = TriageConfig(triage_mode="diagnose", triage_gap_sign=-1, triage_nonfinite_max_frac=0.0)
    before = dataclasses.asdict(c)
    c.validate_triage()
    assert dataclasses.asdict(c) == before


def test_hf_argument_parser_turns_literals_into_choices():
    """`from __future__ import annotations` leaves the annotations as strings: HfArgumentParser must resolve them."""
    parser = HfArgumentParser(TriageConfig)
    (c,) = parser.parse_args_into_dataclasses(
        ["--triage_mode", "diagnose", "--triage_gap_sign", "-1", "--triage_repair_mode", "mask",
         "--triage_nonfinite_max_frac", "0.05", "--triage_segment_mode", "fixed"]
    )
    assert (c.triage_mode, c.triage_gap_sign, c.triage_repair_mode) == ("diagnose", -1, "mask")
    assert (c.triage_nonfinite_max_frac, c.triage_segment_mode) == (0.05, "fixed")
    assert type(c.triage_gap_sign) is int
    actions = {a.dest: a for a in parser._actions}
    assert tuple(actions["triage_mode"].choices) == ("full", "diagnose", "off")
    assert tuple(actions["triage_gap_sign"].choices) == (1, -1)
    assert tuple(actions["triage_rebalance_scope"].choices) == ("segment", "tail")
    assert tuple(actions["triage_repair_mode"].choices) == ("excess_is", "mask", "none")
    assert actions["triage_nonfinite_max_frac"].help.startswith("Largest share")
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--triage_mode", "on"])
