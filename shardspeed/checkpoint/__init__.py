"""Everything about checkpoints on disk (DeepSpeed documents this package as
``deepspeed.checkpoint``).

- :mod:`.files`: file and folder names of a checkpoint, finding a tag;
- :mod:`.reader`: :func:`~.reader.load_file`, through which every checkpoint file is read, with
  ``weights_only=True`` and :mod:`.allowlist` (DeepSpeed's data-only types, as plain data);
- :mod:`.manifest`: the per-tag list of files, sizes and CRC-32s, checked before a load;
- :mod:`.snapshot`, :mod:`.file_writer`, :mod:`.durable`, :mod:`.commit`: writing a tag whole or
  not at all (plain data only, durable files in a staging folder, the manifest, the rename, then
  ``latest``); :mod:`.crash_points`: the test-only hook that kills or fails a save at a point;
- :mod:`.layout`: the typed, versioned layout of saved optimizer state (which parameter sits
  where in which flat bucket);
- :mod:`.sources`: every saved form of optimizer state (shardspeed's stages 0-2, universal
  folders, DeepSpeed's ZeRO 1/2/3) as per-rank shards; :mod:`.deepspeed_zero3`: DeepSpeed's
  ZeRO-3 tags (each parameter partitioned on its own, the weights in the optimizer shards);
- :mod:`.reshard`: re-partitioning those shards for another data-parallel size, bucket layout
  or stage;
- :mod:`.planner`: what each file of a save holds, as pieces of global tensors (name, global
  shape, offsets), recorded in the model-states file and checked before a load;
- :mod:`.consolidate`: one fp32 ``state_dict`` from a checkpoint (``zero_to_fp32``, also at
  DeepSpeed's path :mod:`shardspeed.utils.zero_to_fp32`);
- :mod:`.standalone`: the torch-only ``zero_to_fp32.py`` written beside every checkpoint;
- :mod:`.ds_to_universal`: conversion to the universal form, each parameter whole;
- :mod:`.utils`: ``clone_tensors_for_torch_save``.

Layer 2: nothing here imports ``shardspeed.runtime``; the ZeRO strategies and the checkpointer
use it.
"""

from shardspeed.checkpoint.files import UNIVERSAL_CHECKPOINT_INFO

__all__ = ["UNIVERSAL_CHECKPOINT_INFO"]
