"""DeepSpeed's memory-requirement estimators for ZeRO-2 and ZeRO-3 model states (spec §24).

The formulas are the ones DeepSpeed documents, in bytes; the printed tables use GiB
(``bytes / 2**30``) labelled "GB", as DeepSpeed prints them. The ZeRO-2 GPU figure without
offload follows the documented ``4P + 16P/N`` (it reproduces the documented t5-3b table);
DeepSpeed's 0.19 code computes ``2P + 18P/N`` instead. DeepSpeed names these functions under
``runtime.zero.stage_1_and_2`` and ``runtime.zero.stage3``, which re-export them.

ZeRO-3 (all bytes): gathering the largest layer takes ``4 L`` on the GPU (fp16 parameters and
gradients of its ``L`` parameters); without offload each GPU also holds ``18 P / N``
(fp16 parameters, fp32 master, gradients, two Adam moments); with the optimizer offloaded,
``2 P / N`` (fp16 parameters) and the CPU takes ``16 P`` per node's share, ``18 P`` when the
parameters go too. Without ``zero.Init`` the CPU must first hold the whole fp32 model per GPU
(``4 P n_gpus``). CPU figures carry ``additional_buffer_factor`` (1.5).
"""

from __future__ import annotations

from torch import nn


def _header(total_params: int, num_gpus_per_node: int, num_nodes: int, extra: str = "") -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
        f"SW: Model with {int(total_params / 1e6)}M total params{extra}."
    )
    print("  per CPU  |  per GPU |   Options")


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
    _header(total_params, num_gpus_per_node, num_nodes)
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


# -- ZeRO-3 ----------------------------------------------------------------------------------------
def zero3_model_to_params(model: nn.Module) -> tuple[int, int]:
    """(total parameters counting shared tensors once, parameters of the largest module's own
    parameters): what the ZeRO-3 estimate needs (DeepSpeed's stage3 ``model_to_params``)."""
    largest = max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    return model_to_params(model), largest


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(CPU bytes, GPU bytes per device, bytes to gather the largest layer) under ZeRO-3;
    ``cpu_offload_params`` counts only with ``cpu_offload`` (parameters offload with the
    optimizer, never alone)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = num_gpus_per_node / total_gpus
    largest_layer_memory = 4 * largest_layer_params
    fp32_model = total_params * 4 * num_gpus_per_node  # the model built on CPU, per GPU
    gpu_mem: float
    cpu_mem: float
    if not cpu_offload:
        gpu_mem = largest_layer_memory + 18 * total_params / total_gpus
        cpu_mem = (largest_layer_params * 4 * num_gpus_per_node) if zero_init else fp32_model
    else:
        per_param = 18 if cpu_offload_params else 16
        gpu_mem = largest_layer_memory + (
            0 if cpu_offload_params else 2 * total_params / total_gpus
        )
        share = total_params * per_param * gpus_factor
        cpu_mem = share if zero_init else max(fp32_model, share)
    return int(cpu_mem * additional_buffer_factor), int(gpu_mem), largest_layer_memory


def _print_zero3_table(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int,
    num_nodes: int,
    additional_buffer_factor: float,
) -> None:
    extra = f", {int(largest_layer_params / 1e6)}M largest layer params"
    _header(total_params, num_gpus_per_node, num_nodes, extra)
    for offload_param, offload_optimizer in (("cpu", "cpu"), ("none", "cpu"), ("none", "none")):
        for zero_init in (1, 0):
            cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                cpu_offload=offload_optimizer == "cpu",
                cpu_offload_params=offload_param == "cpu",
                zero_init=bool(zero_init),
                additional_buffer_factor=additional_buffer_factor,
            )
            option = (
                f"offload_param={offload_param:4}, offload_optimizer={offload_optimizer:4}, "
                f"zero_init={zero_init:d}"
            )
            print(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {option}")


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-3 memory table for the parameters and largest layer of the live ``model``."""
    total, largest = zero3_model_to_params(model)
    _print_zero3_table(total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-3 memory table from parameter counts, without the model."""
    _print_zero3_table(
        int(total_params),
        int(largest_layer_params),
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
    )
