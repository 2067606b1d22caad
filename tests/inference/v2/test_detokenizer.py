"""Incremental detokenization and stop strings (no server): streamed pieces concatenate to the
whole decode, incomplete UTF-8 waits for its next byte, stop strings cut and hold back."""

from __future__ import annotations

import pytest

from shardspeed.inference.v2.serving.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TextAssembler,
)


def _byte_level_tokenizer() -> object:
    """A byte-level tokenizer with one token per byte (no merges): a two-byte character takes
    two tokens, so decoding its first token alone is incomplete."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


@pytest.mark.timeout(60)
def test_pieces_concatenate_to_the_whole_decode() -> None:
    tokenizer = _byte_level_tokenizer()
    text = "héllo wörld, ünïcode ✓ done"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text)  # multi-byte characters span tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # the first byte of a two-byte character was held back


@pytest.mark.timeout(60)
def test_stop_strings_cut_and_hold_back() -> None:
    matcher = StopStringMatcher(["STOP", "xyz"])
    first, hit = matcher.push("abc S")
    assert first == "ab" and not hit  # the last 3 characters could start "STOP"
    rest = [matcher.push(p) for p in ("T", "Ox", "P tail")]
    assert not any(h for _, h in rest)  # "STOx" is no stop string
    assert first + "".join(o for o, _ in rest) + matcher.flush() == "abc STOxP tail"
    matcher = StopStringMatcher(["STOP"])
    out = [matcher.push(p) for p in ("ab", "cS", "TO", "P more")]
    assert "".join(o for o, _ in out) == "abc" and out[-1][1] and matcher.text == "abc"
    empty = StopStringMatcher([])
    assert empty.push("all of it") == ("all of it", False)


@pytest.mark.timeout(60)
def test_assembler_flushes_held_text_at_the_end() -> None:
    tokenizer = _byte_level_tokenizer()
    ids = tokenizer("say ST")["input_ids"]
    assembler = TextAssembler(tokenizer, ["STOP"])
    out = [assembler.add(t, i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(o for o, _ in out) == "say ST"  # "ST" was held, then flushed at the end
    assert not any(stopped for _, stopped in out)
