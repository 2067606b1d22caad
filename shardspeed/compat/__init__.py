"""Compatibility with code written for DeepSpeed under its own name (``import deepspeed``).

:mod:`.module_alias` maps one package name onto another in ``sys.modules``;
:mod:`.deepspeed_shim` is what the opt-in ``deepspeed`` compatibility distribution
(``compat/deepspeed`` in the repository) calls, and what ``shardspeed-report`` asks to learn
which package ``import deepspeed`` gives.
"""
