"""The standalone ``zero_to_fp32.py`` that ``save_checkpoint`` writes beside every checkpoint.

A checkpoint must be consolidable where shardspeed is not installed, with torch alone. The code
that does it lives in this package's modules (:data:`MODULES`), which import nothing but the
standard library, torch and each other; :func:`script_text` joins their source into one script,
leaving out their imports of each other (every name they import from the package is defined
earlier in the script) and their module docstrings.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

#: the file name of the script, as DeepSpeed names it
SCRIPT_NAME = "zero_to_fp32.py"
#: the modules of this package the script is made of, each after those it imports from
MODULES = (
    "files",
    "manifest",
    "allowlist",
    "reader",
    "layout",
    "deepspeed_zero3",
    "sources",
    "tp_layout",
    "consolidate",
)
_PACKAGE = "shardspeed.checkpoint"

_HEADER = '''"""Consolidate a ZeRO checkpoint into one fp32 ``state_dict`` (DeepSpeed's ``zero_to_fp32``).

Written by shardspeed's ``save_checkpoint`` beside the checkpoint; needs only torch (and
safetensors for ``--safe_serialization``), not shardspeed. The code is shardspeed's own, from
shardspeed/checkpoint/{modules}.py, joined into one file::

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [--tag TAG] [--max_shard_size 5GB]
        [--safe_serialization] [--exclude_frozen_parameters] [--verify_checksums]
        [--allow_unsafe_pickle]

Files are read with torch.load(weights_only=True): loading runs no code the checkpoint names.
With shardspeed installed, ``shardspeed.utils.zero_to_fp32`` holds the same functions
(``get_fp32_state_dict_from_zero_checkpoint``, ``load_state_dict_from_zero_checkpoint``,
``convert_zero_checkpoint_to_fp32_state_dict``).
"""

from __future__ import annotations
'''


def _defined(tree: ast.Module) -> set[str]:
    """The names a module's top level defines (functions, classes, assignments)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _left_out(tree: ast.Module, name: str) -> list[ast.stmt]:
    """The statements of module ``name`` the script leaves out: its docstring, its
    ``from __future__`` line and its imports from this package, which must be top-level
    ``from shardspeed.checkpoint.<module> import <names>`` (the names then stand in the script
    as they are)."""
    docstring = ast.get_docstring(tree, clean=False) is not None
    left_out: list[ast.stmt] = tree.body[:1] if docstring else []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            left_out.append(node)
            continue
        if isinstance(node, ast.Import):
            package = any(a.name.split(".")[0] == "shardspeed" for a in node.names)
            plain = False
        elif isinstance(node, ast.ImportFrom):
            package = bool(node.level) or (node.module or "").split(".")[0] == "shardspeed"
            plain = (
                node in tree.body
                and (node.module or "").startswith(f"{_PACKAGE}.")
                and all(a.asname is None for a in node.names)
            )
        else:
            continue
        if package and not plain:
            raise RuntimeError(
                f"{name}.py:{node.lineno}: only top-level `from {_PACKAGE}.<module> import "
                f"<names>` (no aliases) can be left out of {SCRIPT_NAME}"
            )
        if package:
            left_out.append(node)
    return left_out


def _body(name: str, defined: set[str]) -> str:
    """Module ``name``'s source less what :func:`_left_out` names; checks that the names it
    imports from this package are in ``defined`` (the script so far, which it extends) and that
    it defines none of them again."""
    source = (Path(__file__).parent / f"{name}.py").read_text()
    tree = ast.parse(source)
    dropped: set[int] = set()
    for node in _left_out(tree, name):
        dropped.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            missing = sorted({a.name for a in node.names} - defined)
            if missing:
                raise RuntimeError(f"{name}.py imports {missing} from a module not before it")
    again = sorted(_defined(tree) & defined)
    if again:
        raise RuntimeError(f"{name}.py defines {again} again: the script would hold both")
    defined.update(_defined(tree))
    lines = source.splitlines(keepends=True)
    kept = [line for number, line in enumerate(lines, 1) if number not in dropped]
    return "".join(kept).lstrip("\n")


@functools.cache
def script_text() -> str:
    """The source of the standalone ``zero_to_fp32.py``."""
    defined: set[str] = set()
    parts = [_HEADER.format(modules="{" + ",".join(MODULES) + "}")]
    for name in MODULES:
        parts.append(f"\n\n# ---- shardspeed/checkpoint/{name}.py ----\n\n")
        parts.append(_body(name, defined))
    parts.append('\n\nif __name__ == "__main__":\n    main()\n')
    return "".join(parts)


def write_script(directory: str | os.PathLike[str]) -> Path:
    """Write :func:`script_text` to ``directory/zero_to_fp32.py`` (to a temporary name first,
    then renamed: a reader never sees half a script); returns its path."""
    path = Path(directory) / SCRIPT_NAME
    tmp = path.with_name(SCRIPT_NAME + ".tmp")
    tmp.write_text(script_text())
    os.replace(tmp, path)
    return path
