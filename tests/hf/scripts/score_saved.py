"""In a plain process (no launcher): load each ``DIR/<case>/final`` that ``trainer_cases.py``
saved with ``from_pretrained`` and print its loss on the fixed batch; for a DeepSpeed case also
the loss of the weights ``zero_to_fp32`` consolidates from the Trainer's last checkpoint.

Usage: ``python score_saved.py DIR case [case ...]``; prints one JSON object: case -> loss and
``case:zero_to_fp32`` -> loss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from hf_common import score
from trainer_cases import MAX_STEPS


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
        checkpoint = root / case / "run" / f"checkpoint-{MAX_STEPS}"
        if case != "ddp":
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
            model.load_state_dict(weights, strict=True)
            scores[f"{case}:zero_to_fp32"] = score(model)
    print(json.dumps(scores))


if __name__ == "__main__":
    main()
