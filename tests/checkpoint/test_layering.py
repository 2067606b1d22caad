"""``shardspeed.checkpoint`` is layer 2 (mechanisms): it imports no other part of shardspeed, so
the ZeRO strategies and the checkpointer above it can use it and the standalone script can be
made of it."""

from __future__ import annotations

import ast
from pathlib import Path

import shardspeed.checkpoint


def test_the_package_imports_only_itself():
    package = Path(shardspeed.checkpoint.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                inside = module == "shardspeed.checkpoint" or module.startswith(
                    "shardspeed.checkpoint."
                )
                assert inside or module.split(".")[0] != "shardspeed", (path.name, module)
