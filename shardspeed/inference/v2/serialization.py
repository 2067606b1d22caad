"""``InferenceEngineV2.serialize`` and ``build_engine_from_ds_checkpoint``: an engine's model
saved per tensor-parallel rank and loaded back without the Hugging Face checkpoint or re-sharding.

The files keep DeepSpeed's names: ``params_rank_{r}_of_{n}.pt`` (rank ``r``'s tensors) and
``metadata_rank_{r}_of_{n}.json`` per rank, and the model's config from rank 0. Their contents
are shardspeed's and safe to load from anywhere: the tensors are a plain ``{name: tensor}``
dict read with ``torch.load(weights_only=True)``, the config is Hugging Face's ``config.json``
(DeepSpeed pickles it as ``ds_model_config.pkl``, which would run code on load), and the
metadata lists every tensor's shape and dtype, which loading checks before using any of them.
A DeepSpeed-written v2 checkpoint (its flat buffers follow DeepSpeed's CUDA kernels' layouts)
is refused with the way out: build from the Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardspeed.inference.quantization import Int8Linear
from shardspeed.inference.tp_group import TPGroup
from shardspeed.inference.weight_source import ModuleWeights

__all__ = [
    "FORMAT",
    "is_serialized_engine",
    "load_model",
    "metadata_filename",
    "param_filename",
    "save_model",
]

FORMAT = "shardspeed-inference-v2"
VERSION = 1
BUFFER = "non_persistent_buffer:"  # the key prefix of buffers outside the state dict
DEEPSPEED_CONFIG = "ds_model_config.pkl"


def param_filename(base: str | os.PathLike[str], rank: int, n_ranks: int) -> Path:
    """Rank ``rank``'s tensors (DeepSpeed's file name)."""
    return Path(base) / f"params_rank_{rank}_of_{n_ranks}.pt"


def metadata_filename(base: str | os.PathLike[str], rank: int, n_ranks: int) -> Path:
    """Rank ``rank``'s metadata (DeepSpeed's file name)."""
    return Path(base) / f"metadata_rank_{rank}_of_{n_ranks}.json"


def is_serialized_engine(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by ``serialize`` (shardspeed's or DeepSpeed's)."""
    folder = Path(path)
    return folder.is_dir() and ((folder / DEEPSPEED_CONFIG).exists() or bool(_saved_sizes(folder)))


def _saved_sizes(folder: Path) -> list[int]:
    """The tensor-parallel sizes that rank-0 metadata files in ``folder`` were saved with."""
    sizes = []
    for entry in folder.glob("metadata_rank_0_of_*.json"):
        found = re.fullmatch(r"metadata_rank_0_of_(\d+)\.json", entry.name)
        if found:
            sizes.append(int(found.group(1)))
    return sorted(sizes)


def _write_atomically(target: Path, write: Any) -> None:
    """``write(file_path)`` into a temporary file beside ``target``, then rename it over
    ``target``: a crash leaves the old file or the new one, never half of one."""
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(handle)
    try:
        write(temp)
        os.replace(temp, target)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def save_model(
    hf_model: nn.Module,
    family: str,
    path: str | os.PathLike[str],
    tp: TPGroup,
    grain: int = 1,
) -> None:
    """Write this rank's tensors and metadata (and, on rank 0, the config) under ``path``
    (``grain``: the ``tp_grain_size`` the shards were cut with)."""
    for name, module in hf_model.named_modules():
        if isinstance(module, Int8Linear):
            raise ValueError(
                f"serialize: {name} is int8-quantized; serialize the model before quantizing it "
                "(quantized layers are rebuilt from their float weights)."
            )
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach() for name, t in hf_model.state_dict().items()}
    # buffers outside the state dict (rotary inverse frequencies) too: their dtype depends on
    # how the model was built and cast, and the logits on it
    state.update({BUFFER + name: t.detach() for name, t in _non_persistent(hf_model).items()})
    # views of one fused weight (q/k/v, gate/up) are saved as what they show, each its own
    # tensor: a loader never has to trust an offset into some other tensor's storage
    state = {name: t.contiguous().clone() if _is_view(t) else t for name, t in state.items()}
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "policy": family,
        "tp_rank": tp.rank,
        "tp_size": tp.size,
        "tp_grain_size": grain,
        "tensors": {
            name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in state.items()
        },
    }
    cpu = {name: t.cpu() for name, t in state.items()}
    _write_atomically(param_filename(folder, tp.rank, tp.size), lambda temp: torch.save(cpu, temp))
    if tp.rank == 0:
        config = getattr(hf_model, "config", None)
        if config is None:
            raise ValueError("serialize: the model has no Hugging Face config to save.")
        config.save_pretrained(str(folder))
        generation = getattr(hf_model, "generation_config", None)
        if generation is not None:  # its end-of-sequence ids, for a server started on it
            generation.save_pretrained(str(folder))
    # the metadata last: a folder with it names complete files for its rank
    text = json.dumps(metadata, indent=1)
    _write_atomically(
        metadata_filename(folder, tp.rank, tp.size), lambda temp: Path(temp).write_text(text)
    )


def _non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers that its state dict leaves out, by qualified name."""
    found = {}
    for module_name, module in model.named_modules():
        for leaf in module._non_persistent_buffers_set:
            buffer = module._buffers.get(leaf)
            if buffer is not None:
                found[f"{module_name}.{leaf}" if module_name else leaf] = buffer
    return found


def _is_view(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()


def read_metadata(path: str | os.PathLike[str], tp: TPGroup) -> dict[str, Any]:
    """This rank's metadata, checked (ValueError naming the problem and the fix)."""
    folder = Path(path)
    if (folder / DEEPSPEED_CONFIG).exists():
        raise ValueError(
            f"{folder} holds a DeepSpeed inference v2 checkpoint ({DEEPSPEED_CONFIG}): its config "
            "is a pickle (loading it could run code) and its buffers follow DeepSpeed's CUDA "
            "kernels' layouts; build the engine from the model's Hugging Face checkpoint "
            "instead (build_hf_engine on that folder)."
        )
    file = metadata_filename(folder, tp.rank, tp.size)
    if not file.exists():
        sizes = _saved_sizes(folder)
        if sizes:
            raise ValueError(
                f"{folder} was serialized with tensor_parallel.tp_size={sizes[0]}, and this "
                f"engine has tp_size={tp.size}; load it with tp_size={sizes[0]}, or build from "
                "the Hugging Face checkpoint to use another size."
            )
        raise ValueError(f"{folder} has no {file.name}: it was not written by serialize().")
    try:
        metadata = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{file} is not readable JSON ({exc}); serialize the engine again."
        ) from exc
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise ValueError(f"{file} is not shardspeed's serialized engine metadata ({FORMAT}).")
    if metadata.get("version") != VERSION:
        raise ValueError(
            f"{file} has format version {metadata.get('version')!r}; this shardspeed reads "
            f"version {VERSION}: serialize the engine again with this version."
        )
    if metadata.get("tp_rank") != tp.rank or metadata.get("tp_size") != tp.size:
        raise ValueError(
            f"{file} names rank {metadata.get('tp_rank')} of {metadata.get('tp_size')}."
        )
    tensors = metadata.get("tensors")
    if not isinstance(tensors, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("dtype"), str)
        for v in tensors.values()
    ):
        raise ValueError(f"{file}: 'tensors' must map each name to its shape and dtype.")
    return metadata


def read_state(
    path: str | os.PathLike[str], tp: TPGroup, metadata: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """This rank's tensors, loaded safely and checked against ``metadata``."""
    file = param_filename(path, tp.rank, tp.size)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ValueError(f"{file} is missing: serialize the engine again.") from exc
    except Exception as exc:  # noqa: BLE001 - pickle errors of many kinds: untrusted input
        raise ValueError(
            f"{file} is not a plain dict of tensors ({type(exc).__name__}: {exc}); it is refused "
            "unread rather than unpickled. Serialize the engine again."
        ) from exc
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(f"{file} must hold a dict of tensor names to tensors.")
    # each tensor owns its whole storage, contiguously; two names may share one only as the
    # same tensor (tied weights): no weight is a window onto another's memory
    seen: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        first = seen.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        if (
            not tensor.is_contiguous()
            or _is_view(tensor)
            or (
                first is not tensor
                and (
                    first.shape != tensor.shape or first.storage_offset() != tensor.storage_offset()
                )
            )
        ):
            raise ValueError(
                f"{file}: {name} is a view into shared or larger storage; each saved tensor "
                "must be its own contiguous tensor."
            )
    expected = metadata["tensors"]
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{file} does not match its metadata: missing {missing[:4]}, unexpected {extra[:4]}."
        )
    for name, spec in expected.items():
        tensor = state[name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        if list(tensor.shape) != spec["shape"] or dtype != spec["dtype"]:
            raise ValueError(
                f"{file}: {name} is {dtype} {list(tensor.shape)}, its metadata says "
                f"{spec['dtype']} {spec['shape']}."
            )
    return state


def load_model(
    path: str | os.PathLike[str],
    tp: TPGroup,
    grain: int,
    dtype: torch.dtype | None,
    device: torch.device,
) -> tuple[nn.Module, str]:
    """This rank's model from a folder written by ``serialize`` (and the family its metadata
    names): built from the saved config with no weights, split by the same AutoTP plan as when
    saved, then given the saved tensors."""
    from shardspeed.inference.autotp import apply_plan
    from shardspeed.inference.tp_plan import build_plan

    metadata = read_metadata(path, tp)
    if tp.size > 1 and metadata.get("tp_grain_size", 1) != grain:
        raise ValueError(
            f"{path} was cut with tensor_parallel.tp_grain_size={metadata.get('tp_grain_size')} "
            f"and this engine has {grain}; load it with the same grain size."
        )
    state = read_state(path, tp, metadata)
    floats = {
        str(t.dtype) for k, t in state.items() if not k.startswith(BUFFER) and t.is_floating_point()
    }
    if len(floats) > 1:
        raise ValueError(f"{path}: its weights mix dtypes {sorted(floats)}; a model has one.")
    try:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - the hf extra is what v2 needs anyway
        raise ImportError("loading a serialized engine needs `pip install shardspeed[hf]`") from exc
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if getattr(config, "model_type", None) != metadata["policy"]:
        raise ValueError(
            f"{path}: config.json is a {getattr(config, 'model_type', None)!r} model and the "
            f"metadata names {metadata['policy']!r}; the folder mixes two models' files."
        )
    with init_empty_weights():  # parameters on the meta device, buffers real
        model = AutoModelForCausalLM.from_config(config)
    buffers = {k[len(BUFFER) :]: state.pop(k) for k in [k for k in state if k.startswith(BUFFER)]}
    own = _non_persistent(model)
    unknown = sorted(set(buffers) - set(own))
    if unknown:
        raise ValueError(f"{path}: saved buffers {unknown[:4]} are not in the model.")
    for name, tensor in buffers.items():
        if tensor.shape != own[name].shape or (
            tensor.is_floating_point() != own[name].is_floating_point()
        ):
            raise ValueError(
                f"{path}: saved buffer {name} is {tensor.dtype} {list(tensor.shape)}; the model's "
                f"is {own[name].dtype} {list(own[name].shape)}."
            )
    if tp.size > 1:
        # the shards are made in the saved dtype, so copying the saved tensors in keeps it
        saved = next((t.dtype for t in state.values() if t.is_floating_point()), None)
        plan = build_plan(model, tp.size, tp.rank, grain)
        apply_plan(model, plan, tp, _Unwritten(model), saved, torch.device("cpu"))
        model.load_state_dict(state, strict=True)
    else:
        model.load_state_dict(state, strict=True, assign=True)
    for name, tensor in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = tensor
    model = model.to(device=device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model.eval(), str(metadata["policy"])


class _Unwritten(ModuleWeights):
    """A weight source of uninitialized tensors shaped as the pieces asked for: the model's
    structure is split as when it was saved, the saved tensors are copied in afterwards."""

    def read(self, name: str, piece: Any, shape: torch.Size) -> torch.Tensor:
        shaped = super().read(name, piece, shape)  # a view of a meta tensor: no data
        return torch.empty(shaped.shape, dtype=shaped.dtype)
