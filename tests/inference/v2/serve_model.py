"""A tiny Llama checkpoint with a word-level tokenizer and a chat template, saved with
``save_pretrained`` (no downloads), plus Hugging Face ``generate`` as the reference the serving
tests compare against."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

WORDS = 60
SERVED_NAME = "tiny-llama"  # the name the test server serves the checkpoint under
MAX_POSITIONS = 512
# "<s>" starts the conversation; each message is "ROLE: words" and the reply starts after "w0"
CHAT_TEMPLATE = (
    "<s> {% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w0{% endif %}"
)


def save_tiny_llama(folder: Path) -> Path:
    """A 2-layer Llama (vocab 64+3 role words) and its tokenizer for ``w0 .. w59``, saved in
    ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    words = [f"w{i}" for i in range(WORDS)] + ["system", "user", "assistant"]
    vocab = {token: i for i, token in enumerate(specials + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
        eos_token="</s>",
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=MAX_POSITIONS,
        pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # larger weights than the init's 0.02 so greedy outputs vary from token to token
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    return folder


class Reference:
    """Hugging Face ``generate`` (greedy, fp32) on the saved checkpoint."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        self.model.eval()

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate_ids(self, ids: list[int], max_new_tokens: int, **kwargs: Any) -> list[int]:
        """Greedy ``generate`` after ``ids``; ``kwargs`` go to ``generate`` too."""
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **kwargs,
            )
        return [int(t) for t in out[0, len(ids) :]]

    def text(self, ids: list[int], max_new_tokens: int) -> str:
        new = self.generate_ids(ids, max_new_tokens)
        return str(self.tokenizer.decode(new, skip_special_tokens=True))


REPO = Path(__file__).resolve().parents[3]
STARTUP_S = 120.0


def start_server(
    model_dir: Path, *extra: str, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``shardspeed serve`` on ``model_dir`` as a child process on a free port (small KV cache
    and batch; ``extra`` flags and ``env_extra`` variables added), and its base URL once
    ``/health`` answers. Its output goes to a file (a pipe nobody drains would block a server
    that logs a lot)."""
    # not the distributed variables an in-process test may have exported
    dist_vars = {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [
        sys.executable, "-m", "shardspeed.launcher.runner", "serve", "--model", str(model_dir),
        "--port", "0", "--served-model-name", SERVED_NAME, "--max-batch-tokens", "64",
        "--kv-block-size", "8", "--kv-blocks", "64", "--log-level", "warning", *extra,
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        cmd, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT, text=True
    )
    proc.log = log  # type: ignore[attr-defined]
    try:
        return proc, _wait_ready(proc, Path(log.name), time.monotonic() + STARTUP_S)
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen[str]) -> int:
    """SIGTERM the server, reap it (SIGKILL after 20 s) and return its exit code."""
    proc.terminate()
    try:
        code = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait(timeout=20)
    log = getattr(proc, "log", None)
    if log is not None:
        log.close()
        os.unlink(log.name)
    return code


def _wait_ready(proc: subprocess.Popen[str], log: Path, deadline: float) -> str:
    """The base URL once the process wrote its address to ``log`` and /health answers 200."""
    import httpx

    url = None
    while url is None:
        text = log.read_text()
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError(f"server did not start: {text}")
        found = re.search(r"listening on (http://\S+)", text)
        url = found.group(1) if found else None
        if url is None:
            time.sleep(0.2)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never became healthy")
