"""ZeRO-3 leaf modules (DeepSpeed's ``deepspeed.utils.set_z3_leaf_modules`` and friends).

(DeepSpeed keeps them in ``deepspeed/utils/z3_leaf_module.py``; here the file has another name
so that ``shardspeed.utils.z3_leaf_module`` stays the function, whatever was imported first.)

A leaf module's whole subtree is gathered as one unit and nothing beneath it gets hooks: the
fix where ranks run different submodules in one forward (a Mixture-of-Experts router sending
tokens to different experts), which would otherwise gather different parameters on different
ranks. The mark is a flag on the module instance, read when the stage 3 strategy plans its
gather units (so mark before ``initialize``); the config's ``zero_optimization.leaf_module``
applies the same marks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

#: the flag DeepSpeed sets on a module instance
Z3_LEAF_ATTR = "_z3_leaf"


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked as a leaf."""
    return bool(getattr(model, Z3_LEAF_ATTR, False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` is gathered with a leaf module's subtree."""
    from shardspeed.runtime.zero.records import record_of  # lazy: keeps utils torch-light

    record = record_of(param)
    unit = None if record is None else record.unit
    return unit is not None and z3_leaf_module(unit.module)


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) one module instance."""
    model.__dict__[Z3_LEAF_ATTR] = flag


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model``'s tree marked as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _class_matcher(classes: Sequence[type | str]) -> Callable[[nn.Module], bool]:
    types = tuple(c for c in classes if isinstance(c, type))
    names = {c for c in classes if isinstance(c, str)}

    def matches(module: nn.Module) -> bool:
        cls = type(module)
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        return isinstance(module, types) or cls.__name__ in names or qualified in names

    return matches


def _mark(
    model: nn.Module,
    chosen: Callable[[str, nn.Module], bool],
    flag: bool,
    what: str,
    raise_if_not_found: bool,
) -> list[nn.Module]:
    marked = []
    for name, module in model.named_modules():
        if chosen(name, module):
            set_z3_leaf_module(module, flag)
            marked.append(module)
    if not marked and raise_if_not_found:
        raise ValueError(f"no module of the model matches {what}; check the names or classes")
    return marked


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module that is an instance of one of ``leaf_module_classes`` (classes, or
    bare or fully qualified class names); returns the marked modules."""
    matches = _class_matcher(leaf_module_classes)
    return _mark(
        model,
        lambda _, m: matches(m),
        True,
        f"leaf_module_classes={list(leaf_module_classes)}",
        raise_if_not_found,
    )


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for those classes."""
    matches = _class_matcher(leaf_module_classes)
    return _mark(
        model,
        lambda _, m: matches(m),
        False,
        f"leaf_module_classes={list(leaf_module_classes)}",
        raise_if_not_found,
    )


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark the modules whose ``named_modules()`` name is exactly one of ``module_names``."""
    wanted = set(module_names)
    what = f"module_names={list(module_names)}"
    return _mark(model, lambda n, _: n in wanted, True, what, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark the modules whose ``named_modules()`` name ends with one of the suffixes."""
    suffixes = tuple(module_name_suffixes)
    what = f"module_name_suffixes={list(module_name_suffixes)}"
    return _mark(
        model, lambda n, _: bool(n) and n.endswith(suffixes), True, what, raise_if_not_found
    )
