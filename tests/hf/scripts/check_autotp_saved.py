"""In a plain process (no launcher): load each ``DIR/<case>/final`` that
``trainer_autotp_cases.py`` saved with ``AutoModelForCausalLM.from_pretrained`` and compare it
with the tiny Llama's whole shapes and with that run's parameters gathered whole
(``engine_params.pt``), and the trained weights with the DDP run's.

Usage: ``python check_autotp_saved.py DIR case [case ...]``; prints one JSON object: case ->
{``shapes_whole``, ``vs_engine`` (largest absolute difference), ``vs_ddp`` (largest
difference relative to each tensor's largest DDP value)}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from hf_common import llama_config


def main() -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    whole = {n: tuple(p.shape) for n, p in LlamaForCausalLM(llama_config()).named_parameters()}
    ddp = torch.load(root / "ddp" / "engine_params.pt")
    report = {}
    for case in sys.argv[2:]:
        assert (root / case / "final" / "model.safetensors").is_file(), case
        model = AutoModelForCausalLM.from_pretrained(str(root / case / "final"))
        loaded = {n: p.detach() for n, p in model.named_parameters()}
        engine = torch.load(root / case / "engine_params.pt")
        report[case] = {
            "shapes_whole": {n: tuple(p.shape) for n, p in loaded.items()} == whole,
            "vs_engine": max(float((loaded[n] - engine[n]).abs().max()) for n in whole),
            "vs_ddp": max(
                float((loaded[n] - ddp[n]).abs().max() / ddp[n].abs().max()) for n in whole
            ),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
