"""Token ids to text as they arrive: incremental detokenization and stop strings.

The text of a completion is ``tokenizer.decode(generated_ids, skip_special_tokens=True)`` (what
decoding Hugging Face ``generate``'s new tokens gives). Streaming emits it piece by piece: each
new token's text is the difference between decoding a short window with and without it, and a
piece that ends in an incomplete UTF-8 character (``\\ufffd``) waits for the next token. Stop
strings cut the text before their first occurrence; while streaming, the last
``len(longest stop) - 1`` characters are held back until they can no longer start one.
No torch and no HTTP here: the server and ``pipeline`` share it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "TextAssembler"]

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation equals decoding
    the whole list (for tokenizers whose decoding is prefix-stable)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        # ids[prefix:read] is the context already emitted; decoding from ``prefix`` keeps
        # joining rules (spaces between words, merged bytes) the same as a whole decode
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def add(self, token: int) -> str:
        """Append ``token``; returns the text it completes ("" while held back)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (a trailing incomplete character) at the end."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""


class StopStringMatcher:
    """Finds the first stop string in streamed text and holds back a possible partial match."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._sent = 0

    def push(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; returns (text now safe to emit, whether a stop string was hit). After
        a hit the text ends just before the stop string."""
        # a new match must end inside ``delta``, so it starts within ``hold`` chars before it
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            cut = min(hits)
            self.text = self.text[:cut]
            out, self._sent = self.text[self._sent :], cut
            return out, True
        safe = max(self._sent, len(self.text) - self._hold)
        out, self._sent = self.text[self._sent : safe], safe
        return out, False

    def flush(self) -> str:
        """The held-back tail, once generation ended without a stop string."""
        out, self._sent = self.text[self._sent :], len(self.text)
        return out


class TextAssembler:
    """Detokenizer + stop strings for one request: feed tokens, get (delta, stopped)."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(stops)

    @property
    def text(self) -> str:
        """The text so far (including held-back characters; cut at a stop string)."""
        return self.matcher.text

    def add(self, token: int, last: bool) -> tuple[str, bool]:
        """Feed one generated token; ``last`` when the engine finished the request with it.
        Returns the text to emit now and whether a stop string ended the request."""
        piece = self.detokenizer.add(token)
        if last:
            piece += self.detokenizer.flush()
        out, stopped = self.matcher.push(piece)
        if last and not stopped:
            out += self.matcher.flush()
        return out, stopped
