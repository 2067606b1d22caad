"""Import-path shim: DeepSpeed's ``deepspeed.runtime.torch_autocast``. The implementation is
:mod:`shardspeed.runtime.precision.autocast`; no code lives here."""

from shardspeed.runtime.precision.autocast import (
    autocast_if_enabled,
    get_all_comm_dtypes,
    get_autocast_dtype,
    get_comm_dtype,
    get_default_autocast_lower_precision_modules,
    has_comm_dtype,
    init_autocast_params,
    is_autocast_initialized,
    reset_autocast_state,
    sort_dtypes,
)

__all__ = [
    "autocast_if_enabled",
    "get_all_comm_dtypes",
    "get_autocast_dtype",
    "get_comm_dtype",
    "get_default_autocast_lower_precision_modules",
    "has_comm_dtype",
    "init_autocast_params",
    "is_autocast_initialized",
    "reset_autocast_state",
    "sort_dtypes",
]
