"""Tensor parallelism for training (AutoTP): a model split over the topology's ``tp`` axis.

``apply`` splits a whole model in place inside ``initialize`` following ``plan`` (from
``partition_config`` / ``preset_model`` specs in ``specs`` and ``presets``, the model's Hugging
Face ``tp_plan``, or the structural rules shared with inference); ``layers`` holds the column-
and row-parallel linears and the vocabulary-parallel embedding, ``collectives`` the
differentiable exchanges, ``partition`` the slicing arithmetic, ``gather`` whole tensors from
the pieces, ``legacy`` DeepSpeed's ``tp_model_init`` / ``set_autotp_mode`` and ``config`` its
``TPTrainingConfig``.
"""
