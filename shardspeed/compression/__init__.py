"""``shardspeed.compression``: DeepSpeed's compression library (quantization-aware training,
pruning, layer reduction, knowledge distillation).

    model = init_compression(model, "ds_config.json", teacher_model=teacher)
    engine, *_ = shardspeed.initialize(model=model, config="ds_config.json")  # steps the schedule
    ...train...
    model = redundancy_clean(engine.module, "ds_config.json")  # pruned weights removed
"""

from shardspeed.compression.compress import init_compression, redundancy_clean
from shardspeed.compression.distill import Distiller, hidden_state_loss, logit_distillation_loss
from shardspeed.compression.replace import convert_conv1d_to_linear
from shardspeed.compression.scheduler import compression_scheduler

__all__ = [
    "Distiller",
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "hidden_state_loss",
    "init_compression",
    "logit_distillation_loss",
    "redundancy_clean",
]
