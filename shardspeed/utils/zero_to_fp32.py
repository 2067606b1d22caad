"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: re-exports the consolidation of a ZeRO checkpoint
into one fp32 ``state_dict``, which lives in :mod:`shardspeed.checkpoint.consolidate`.

    python -m shardspeed.utils.zero_to_fp32 <checkpoint_dir> <output_dir> [--tag TAG]
        [--max_shard_size 5GB] [--safe_serialization] [--exclude_frozen_parameters]

The torch-only ``zero_to_fp32.py`` that ``save_checkpoint`` writes beside every checkpoint is
generated from the same modules (:mod:`shardspeed.checkpoint.standalone`). DeepSpeed's file
helpers that clients import from here (Lightning's converter: ``get_model_state_file``,
``get_optim_files``) come from :mod:`shardspeed.checkpoint.files` through it.
"""

from shardspeed.checkpoint.consolidate import (
    LazyTensor,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_checkpoint_files,
    get_fp32_state_dict_from_zero_checkpoint,
    get_model_state_file,
    get_model_state_files,
    get_optim_files,
    load_state_dict_from_zero_checkpoint,
    main,
)

__all__ = [
    "LazyTensor",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

if __name__ == "__main__":
    main()
