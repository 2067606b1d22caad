"""Tensor parallelism for training: layers split over the topology's ``tp`` axis.

``partition`` holds the slicing arithmetic (shared with inference's AutoTP), ``collectives`` the
differentiable exchanges between tensor-parallel ranks, ``layers`` the column- and row-parallel
linears built from a whole ``nn.Linear``, and ``config`` DeepSpeed's ``TPTrainingConfig``.
AutoTP training of whole Hugging Face models (``tensor_parallel.autotp_size``) builds on these
and is not wired into ``initialize`` yet (it refuses the key).
"""
