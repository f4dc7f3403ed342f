"""The ``triage_*`` settings of the TRIAGE objective.

Every choice the objective makes (``docs/objective.md``, a reconstruction of arXiv 2610.07043 from its
abstract) is a field here, so that an ablation is one flag. Fields with a fixed set of values are
``Literal`` types: ``transformers.HfArgumentParser`` (and TRL's ``TrlParser``) turn them into command-line
choices. The dataclass has no TRL import: ``TriageGRPOConfig`` inherits it next to TRL's ``GRPOConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..runtime.validators import check_choice, check_in_range, check_integer_at_least

TriageMode = Literal["full", "diagnose", "off"]
GapSign = Literal[1, -1]
SegmentMode = Literal["newline", "fixed"]
RebalanceScope = Literal["segment", "tail"]
RepairMode = Literal["excess_is", "mask", "none"]
Direction = Literal["aware", "blind"]

TRIAGE_MODES = get_args(TriageMode)
SEGMENT_MODES = get_args(SegmentMode)
REBALANCE_SCOPES = get_args(RebalanceScope)
REPAIR_MODES = get_args(RepairMode)
DIRECTIONS = get_args(Direction)


@dataclass(kw_only=True)  # keyword-only: TriageGRPOConfig keeps TRL's positional output_dir first
class TriageConfig:
    """Settings of the TRIAGE objective (``docs/objective.md``, steps 1-9). Validated at construction.

    Raises:
        ValueError: a field is outside its allowed range; the message names the field, the value
            and the range.
    """

    triage_mode: TriageMode = field(
        default="full",
        metadata={
            "help": "`full`: classify, diagnose, rebalance and repair (steps 1-8). `diagnose`: compute and log "
            "every statistic but keep every weight at 1 (plain GRPO with TRIAGE's instruments; the beta and "
            "weight metrics then describe what `full` would apply). `off`: plain GRPO, nothing computed."
        },
    )
    triage_gap_sign: GapSign = field(
        default=1,
        metadata={
            "help": "Direction convention for classifying tokens: +1 uses gap = learner - sampler "
            "log-prob, -1 flips it (an ablation of the convention). Only the amplifying/contracting "
            "classification flips; the repair weight and mismatch metrics always use learner - sampler."
        },
    )
    triage_tail_quantile: float = field(
        default=0.98,
        metadata={"help": "Quantile of |gap| over diagnosed tokens above which a token is a tail token; in (0, 1)."},
    )
    triage_tail_min_gap: float = field(
        default=0.05,
        metadata={"help": "Lower bound (nats) on the tail threshold tau, so a batch with tiny mismatch has no tail; >= 0."},
    )
    triage_segment_mode: SegmentMode = field(
        default="newline",
        metadata={
            "help": "`newline`: a segment ends after each token whose text contains a newline, and "
            "after `triage_segment_max_tokens` tokens. `fixed`: windows of `triage_segment_max_tokens` tokens."
        },
    )
    triage_segment_max_tokens: int = field(
        default=64,
        metadata={"help": "Longest segment, in tokens; >= 1."},
    )
    triage_hot_min_tokens: int = field(
        default=2,
        metadata={"help": "A segment is hot when it holds at least this many amplifying tail tokens; >= 1."},
    )
    triage_hot_density: float = field(
        default=0.10,
        metadata={"help": "...and when amplifying tail tokens are at least this share of its diagnosed tokens; in [0, 1]."},
    )
    triage_rebalance_floor: float = field(
        default=0.25,
        metadata={"help": "Smallest rebalancing factor beta applied to the heavier amplifying quadrant; in (0, 1]."},
    )
    triage_rebalance_scope: RebalanceScope = field(
        default="segment",
        metadata={
            "help": "`segment`: beta applies to every token of the heavier amplifying quadrant in a hot "
            "segment. `tail`: only to its tail tokens."
        },
    )
    triage_repair_mode: RepairMode = field(
        default="excess_is",
        metadata={
            "help": "Bounded repair of severe mismatch. `excess_is`: weight clamp(exp(excess), 1/C, C). "
            "`mask`: weight 0 for severe tokens (MIS-style ablation). `none`: no repair."
        },
    )
    triage_severe_gap: float = field(
        default=math.log(2.0),
        metadata={"help": "|gap| (nats) from which a token's mismatch is severe and repaired; > 0."},
    )
    triage_repair_clip: float = field(
        default=2.0,
        metadata={"help": "Bound C of the repair weight, which stays in [1/C, C]; >= 1."},
    )
    triage_direction: Direction = field(
        default="aware",
        metadata={
            "help": "`aware`: TRIAGE as specified. `blind`: a control, not an objective to train with: every token "
            "TRIAGE reweights (the rebalanced hot segments, any quadrant, and the repaired tokens) gets one common "
            "weight, the mean of TRIAGE's weights over those tokens, so the direction is ignored while the "
            "tokens touched and the mean weight stay TRIAGE's (docs/objective.md, 'Direction-blind control')."
        },
    )
    triage_nonfinite_max_frac: float = field(
        default=0.01,
        metadata={
            "help": "Largest share of a micro-batch's valid tokens whose sampler log-prob may be non-finite "
            "(NaN, +-inf). Those tokens get weight 0; above this share the sampler is broken and training "
            "stops with NonFiniteSamplerLogprobsError. In [0, 1]; 1 never stops."
        },
    )

    def __post_init__(self):
        self.validate_triage()

    def validate_triage(self) -> None:
        """Check every ``triage_*`` field; raise ``ValueError`` naming the first bad one. Changes nothing."""
        check_choice("triage_mode", self.triage_mode, TRIAGE_MODES)
        check_choice("triage_segment_mode", self.triage_segment_mode, SEGMENT_MODES)
        check_choice("triage_rebalance_scope", self.triage_rebalance_scope, REBALANCE_SCOPES)
        check_choice("triage_repair_mode", self.triage_repair_mode, REPAIR_MODES)
        check_choice("triage_direction", self.triage_direction, DIRECTIONS)
        if self.triage_gap_sign not in (1, -1) or isinstance(self.triage_gap_sign, bool):
            raise ValueError(f"triage_gap_sign={self.triage_gap_sign!r} is invalid: it must be 1 or -1.")
        check_in_range("triage_tail_quantile", self.triage_tail_quantile, 0.0, 1.0, "in (0, 1)", lo_open=True, hi_open=True)
        check_in_range("triage_tail_min_gap", self.triage_tail_min_gap, 0.0, math.inf, ">= 0 (nats)")
        check_integer_at_least("triage_segment_max_tokens", self.triage_segment_max_tokens, 1)
        check_integer_at_least("triage_hot_min_tokens", self.triage_hot_min_tokens, 1)
        check_in_range("triage_hot_density", self.triage_hot_density, 0.0, 1.0, "in [0, 1]")
        check_in_range("triage_rebalance_floor", self.triage_rebalance_floor, 0.0, 1.0, "in (0, 1]", lo_open=True)
        check_in_range("triage_severe_gap", self.triage_severe_gap, 0.0, math.inf, "> 0 (nats)", lo_open=True)
        check_in_range("triage_repair_clip", self.triage_repair_clip, 1.0, math.inf, ">= 1")
        check_in_range("triage_nonfinite_max_frac", self.triage_nonfinite_max_frac, 0.0, 1.0, "in [0, 1]")

    def triage_settings(self) -> dict:
        """The ``triage_*`` fields as a plain dict (for logs and model cards)."""
        return {name: getattr(self, name) for name in TriageConfig.__dataclass_fields__}
