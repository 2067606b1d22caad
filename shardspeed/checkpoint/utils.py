"""``clone_tensors_for_torch_save``: save tensors without the storage they are views of.
``get_model_ckpt_name_for_rank``: DeepSpeed's name of a tag's model-states file.

``torch.save`` writes a tensor's whole storage. A ZeRO stage 1/2 model's parameters are views of
flat bucket buffers, so saving a subset of them (one layer, a Hugging Face shard) would write the
whole buffer: clone them first.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_CPU = torch.device("cpu")
MODEL_FILE_PREFIX = "mp_rank_"
MODEL_FILE_SUFFIX = "_model_states.pt"


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank ``mp_rank_str`` (``"00"``) in a tag folder:
    ``base_folder/mp_rank_00_model_states.pt``, as DeepSpeed names it."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: Any, device: torch.device = _CPU) -> Any:
    """A copy of ``item`` with every tensor in it (nested in lists, tuples and dicts) cloned
    onto ``device``; other values are returned as they are."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list | tuple):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
