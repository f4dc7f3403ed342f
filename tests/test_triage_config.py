"""TriageConfig: the spec's defaults and validation errors that name field, value and range."""

import dataclasses
import math

import pytest

from triage_trl import TriageConfig


def test_defaults_are_the_specs():
    c = TriageConfig()
    assert (c.triage_mode, c.triage_gap_sign, c.triage_segment_mode) == ("full", 1, "newline")
    assert (c.triage_tail_quantile, c.triage_tail_min_gap) == (0.98, 0.05)
    assert (c.triage_segment_max_tokens, c.triage_hot_min_tokens, c.triage_hot_density) == (64, 2, 0.10)
    assert (c.triage_rebalance_floor, c.triage_rebalance_scope) == (0.25, "segment")
    assert (c.triage_repair_mode, c.triage_severe_gap, c.triage_repair_clip) == ("excess_is", math.log(2), 2.0)


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
    ],
)
def test_bad_values_raise_naming_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as err:
        TriageConfig(**{field: value})
    message = str(err.value)
    assert message.startswith(f"{field}={value!r}") and allowed in message


def test_triage_settings_lists_all_fields():
    assert set(TriageConfig().triage_settings()) == {f.name for f in dataclasses.fields(TriageConfig)}
