"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2`` path: ZeRO-2 memory estimators.

The formulas are the ones DeepSpeed documents (spec §24), in bytes; the printed tables use
GiB (``bytes / 2**30``) labelled "GB", as DeepSpeed prints them. The GPU figure without offload
follows the documented ``4P + 16P/N`` (it reproduces the documented t5-3b table); DeepSpeed's
0.19 code computes ``2P + 18P/N`` instead.
"""

from __future__ import annotations

from torch import nn

from shardspeed.runtime.zero.partitioned import PartitionedStrategy
from shardspeed.runtime.zero.stage1 import OptimizerStateStrategy
from shardspeed.runtime.zero.stage2 import GradientPartitionStrategy

#: DeepSpeed's class name for the stage 1/2 optimizer; here the shared strategy base
DeepSpeedZeroOptimizer = PartitionedStrategy

__all__ = [
    "DeepSpeedZeroOptimizer",
    "GradientPartitionStrategy",
    "OptimizerStateStrategy",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]


def model_to_params(model: nn.Module) -> int:
    """Total parameters of ``model``, counting tensors shared between modules once."""
    return sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(CPU bytes, GPU bytes per device) for params, gradients and Adam states under ZeRO-2."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * num_gpus_per_node, 16) * additional_buffer_factor
    else:
        gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        # only at start-up, while the model is built on CPU in fp32
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def _print_table(
    total_params: int, num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float
) -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
        f"SW: Model with {int(total_params / 1e6)}M total params."
    )
    print("  per CPU  |  per GPU |   Options")
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor
        )
        option = "offload_optimizer=cpu " if cpu_offload else "offload_optimizer=none"
        print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {option}")


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-2 memory table for the parameters of the live ``model``."""
    _print_table(model_to_params(model), num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-2 memory table for a model of ``total_params`` parameters."""
    _print_table(int(total_params), num_gpus_per_node, num_nodes, additional_buffer_factor)
