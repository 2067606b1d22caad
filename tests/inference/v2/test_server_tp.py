"""``shardspeed serve --tp 2`` as a process: it launches 2 ranks (gloo on CPU) holding half of
the model each; rank 0 answers the official ``openai`` client with Hugging Face ``generate``'s
tokens (greedy, concurrent, streamed, n > 1), and SIGTERM ends the whole job, every rank
included."""

from __future__ import annotations

import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from tests.inference.v2.serve_model import (  # noqa: E402
    SERVED_NAME,
    Reference,
    start_server,
    stop_server,
)

PROMPTS = ["w1 w2", "w5 w9 w13 w7", "w40", "w11 w12 w13", "w3 w3 w3", "w59 w0 w17"]


def _ranks_alive(model_dir: Path) -> list[str]:
    """Processes of a ``--tp`` server on ``model_dir`` (the launcher and its ranks; not the
    package's tp 1 server on the same checkpoint)."""
    out = subprocess.run(
        ["ps", "-eww", "-o", "pid,args"], capture_output=True, text=True, check=True
    )
    return [line for line in out.stdout.splitlines() if str(model_dir) in line and "--tp" in line]


@pytest.mark.timeout(300)
def test_serve_tp2_equals_hf_and_stops_every_rank(model_dir: Path, reference: Reference) -> None:
    # a shell that ran another job: its WORLD_SIZE/RANK/MASTER_PORT (a port now taken) must not
    # make the command think it is already one of the ranks
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    stale = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": str(taken.getsockname()[1])}
    try:
        proc, url = start_server(model_dir, "--tp", "2", env_extra=stale)
    finally:
        taken.close()
    try:
        ranks = [line for line in _ranks_alive(model_dir) if "serving.cli" in line]
        assert len(ranks) == 2, ranks  # the launcher started both ranks
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60.0)

        def ask(i: int) -> str:
            prompt = PROMPTS[i]
            if i % 2:
                out = client.completions.create(
                    model=SERVED_NAME, prompt=prompt, max_tokens=6 + i, temperature=0
                )
                return str(out.choices[0].text)
            stream = client.completions.create(
                model=SERVED_NAME, prompt=prompt, max_tokens=6 + i, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in stream if c.choices)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(ask, range(len(PROMPTS))))
        want = [reference.text(reference.prompt_ids(p), 6 + i) for i, p in enumerate(PROMPTS)]
        assert got == want
        messages = [{"role": "user", "content": "w4 w5 w6"}]
        chat = client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=8, temperature=0, n=2
        )
        expected = reference.text(reference.chat_ids(messages), 8)
        assert [c.message.content for c in chat.choices] == [expected, expected]
    finally:
        code = stop_server(proc)
    assert code in (0, 143), code  # the launcher reports the SIGTERM it forwarded
    deadline = time.monotonic() + 30
    while _ranks_alive(model_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ranks_alive(model_dir) == []
