"""End-of-generation rules and streamed detokenization.

Tokens are committed in bursts (a verification commits several); ``OutputTracker.feed`` takes
them one at a time, so EOS, the token budget and stop strings cut at exactly the token where the
generation must end, whatever the burst size. Text that could still become a stop string (or an
incomplete UTF-8 sequence) is held back from the stream until it is decided.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from card.engine.shared.config import StopParams


@dataclass
class OutputTracker:
    stop: StopParams
    eos_ids: frozenset[int]
    decode: Callable[[list[int]], str]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of ``text`` already streamed
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, tokens: Iterable[int]) -> tuple[list[int], str]:
        """Take committed tokens until a stop; returns (tokens kept, text safe to stream)."""
        kept: list[int] = []
        for token in tokens:
            if self.done:
                break
            self.token_ids.append(token)
            kept.append(token)
            if token in self.eos_ids and not self.stop.ignore_eos:
                self.finish_reason = "eos"
            elif self.stop.stop and self._cut_at_stop_string():
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.stop.max_new_tokens:
                self.finish_reason = "length"
        if self.finish_reason != "stop":
            self.text = self.decode(self.token_ids)
        return kept, self._stream()

    def _cut_at_stop_string(self) -> bool:
        text = self.decode(self.token_ids)
        # a stop string can only newly appear in the tail that this token touched
        window = len(self.text) - max(len(s) for s in self.stop.stop)
        hits = [i for s in self.stop.stop if (i := text.find(s, max(0, window))) >= 0]
        if hits:
            self.text = text[: min(hits)]
            return True
        self.text = text
        return False

    def _stream(self) -> str:
        end = len(self.text)
        if not self.done:
            end -= self._holdback()
        delta = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _holdback(self) -> int:
        # an incomplete UTF-8 sequence is undecided, and so is a stop-string prefix before it
        stable = self.text.rstrip("\ufffd")
        longest = 0
        for s in self.stop.stop:
            for n in range(min(len(s) - 1, len(stable)), 0, -1):
                if stable.endswith(s[:n]):
                    longest = max(longest, n)
                    break
        return len(self.text) - len(stable) + longest
