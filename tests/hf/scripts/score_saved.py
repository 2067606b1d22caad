"""In a plain process (no launcher, no DeepSpeed): load each ``DIR/<case>/final`` that
``trainer_cases.py`` saved with ``from_pretrained`` and print its loss on the fixed batch.

Usage: ``python score_saved.py DIR case [case ...]``; prints one JSON object case -> loss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from hf_common import score


def main() -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    scores = {}
    for case in sys.argv[2:]:
        final = root / case / "final"
        assert (final / "model.safetensors").is_file(), f"no safetensors in {final}"
        model = LlamaForCausalLM.from_pretrained(str(final))
        scores[case] = score(model)
    print(json.dumps(scores))


if __name__ == "__main__":
    main()
