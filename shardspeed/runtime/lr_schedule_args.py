"""LR-schedule names, config keys and command-line flags (``deepspeed.add_tuning_arguments``).

Kept apart from :mod:`shardspeed.runtime.lr_schedules` so that argument parsing needs no torch.
"""

from __future__ import annotations

import argparse
from typing import Any

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MOMENTUM = "cycle_momentum"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

# the flags each schedule reads back from parsed arguments (get_config_from_args)
_FLAGS_BY_SCHEDULE: dict[str, tuple[str, ...]] = {
    LR_RANGE_TEST: (
        LR_RANGE_TEST_MIN_LR,
        LR_RANGE_TEST_STEP_RATE,
        LR_RANGE_TEST_STEP_SIZE,
        LR_RANGE_TEST_STAIRCASE,
    ),
    ONE_CYCLE: (
        CYCLE_FIRST_STEP_SIZE,
        CYCLE_FIRST_STAIR_COUNT,
        CYCLE_SECOND_STEP_SIZE,
        CYCLE_SECOND_STAIR_COUNT,
        DECAY_STEP_SIZE,
        CYCLE_MIN_LR,
        CYCLE_MAX_LR,
        DECAY_LR_RATE,
        CYCLE_MIN_MOM,
        CYCLE_MAX_MOM,
        DECAY_MOM_RATE,
    ),
    WARMUP_LR: (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE),
    WARMUP_DECAY_LR: (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE),
    WARMUP_COSINE_LR: (WARMUP_MIN_RATIO, COS_MIN_RATIO, WARMUP_NUM_STEPS, WARMUP_TYPE),
}


def _str2bool(text: str) -> bool:
    # argparse's type=bool would read "False" as True (any non-empty string)
    low = text.strip().lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's "Convergence Tuning" flags (``--lr_schedule`` and its parameters)."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")

    group.add_argument("--lr_range_test_min_lr", type=float, default=0.001, help="Starting lr.")
    group.add_argument(
        "--lr_range_test_step_rate", type=float, default=1.0, help="Scaling rate for LR range test."
    )
    group.add_argument(
        "--lr_range_test_step_size", type=int, default=1000, help="Training steps per LR change."
    )
    group.add_argument(
        "--lr_range_test_staircase",
        type=_str2bool,
        default=False,
        help="Use staircase scaling for LR range test.",
    )

    group.add_argument(
        "--cycle_first_step_size", type=int, default=1000, help="1Cycle first half (steps)."
    )
    group.add_argument(
        "--cycle_first_stair_count", type=int, default=-1, help="1Cycle first half stair count."
    )
    group.add_argument(
        "--cycle_second_step_size", type=int, default=-1, help="1Cycle second half (steps)."
    )
    group.add_argument(
        "--cycle_second_stair_count", type=int, default=-1, help="1Cycle second half stair count."
    )
    group.add_argument(
        "--decay_step_size", type=int, default=1000, help="Post-cycle decay interval (steps)."
    )
    group.add_argument("--cycle_min_lr", type=float, default=0.01, help="1Cycle LR lower bound.")
    group.add_argument("--cycle_max_lr", type=float, default=0.1, help="1Cycle LR upper bound.")
    group.add_argument("--decay_lr_rate", type=float, default=0.0, help="Post-cycle LR decay rate.")
    group.add_argument(
        "--cycle_momentum", default=False, action="store_true", help="Enable 1Cycle momentum."
    )
    group.add_argument("--cycle_min_mom", type=float, default=0.8, help="1Cycle momentum low.")
    group.add_argument("--cycle_max_mom", type=float, default=0.9, help="1Cycle momentum high.")
    group.add_argument(
        "--decay_mom_rate", type=float, default=0.0, help="Post-cycle momentum decay rate."
    )

    group.add_argument("--warmup_min_lr", type=float, default=0, help="WarmupLR initial LR.")
    group.add_argument("--warmup_max_lr", type=float, default=0.001, help="WarmupLR maximum LR.")
    group.add_argument("--warmup_num_steps", type=int, default=1000, help="WarmupLR steps.")
    group.add_argument(
        "--warmup_type",
        type=str,
        default=WARMUP_LOG_RATE,
        choices=WARMUP_TYPES,
        help="WarmupLR increasing function during warmup.",
    )
    group.add_argument(
        "--warmup_min_ratio", type=float, default=0.01, help="WarmupCosineLR start LR ratio."
    )
    group.add_argument(
        "--cos_min_ratio", type=float, default=0.01, help="WarmupCosineLR end LR ratio."
    )
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """Parse the tuning flags from ``sys.argv``; returns (known args, the rest)."""
    parser = add_tuning_arguments(argparse.ArgumentParser())
    return parser.parse_known_args()


def get_config_from_args(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """A ``{"type", "params"}`` scheduler config from parsed flags, or (None, why not)."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    params = {
        key: getattr(args, key)
        for key in _FLAGS_BY_SCHEDULE[schedule]
        if getattr(args, key, None) is not None
    }
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: dict[str, Any]) -> tuple[float | None, str]:
    """The peak LR a scheduler config names, or (None, why not)."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    key = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR}.get(
        schedule, WARMUP_MAX_LR
    )
    if key not in params:
        return None, f"{schedule} params do not define {key}"
    return params[key], ""
