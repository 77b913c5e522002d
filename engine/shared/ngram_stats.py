"""N-gram statistics of committed text: the tables model-free drafting reads (card.engine.draft.ngram
grows trees from them, beneath a neural draft too) and the cache's per-session lookup
(``PromptLookup``: the chain of a step whose tree holds nothing). Shared by the draft side and the
cache, so it lives here, beside the tree.

Glossary and scores: card.engine.draft.ngram's docstring. Keys pack an n-gram into one int (its
order above n token ids of ``bits`` bits each), a third of a tuple's memory; followers are scored
with Witten-Bell's escape mass, ``p(t) = c(t) / (N + T)``, so path scores stay probabilities.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from card.engine.shared.config import NgramConfig
from card.engine.shared.errors import InvalidArgument

# What one follower costs beyond its dict slot (its token and count objects); the entries' keys and
# dicts are measured with sys.getsizeof, the OrderedDict itself (hash table and links) too.
# tests/engine/test_ngram.py checks the sum against tracemalloc.
_FOLLOWER_BYTES = 56


class NgramTable:
    """Followers of n-grams of orders ``min_order..max_order``; LRU-bounded by ``budget_bytes``
    (None: unbounded, a session's own table). Keys pack an n-gram into one int (its order above
    n token ids of ``bits`` bits each), a third of a tuple's memory."""

    def __init__(self, vocab_size: int, config: NgramConfig, budget_bytes: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.config = config
        self.bits = max(1, (vocab_size - 1).bit_length())
        self.budget_bytes = budget_bytes
        self._entry_bytes = 0  # keys, follower dicts and followers of every entry
        self.evictions = 0
        self._entries: OrderedDict[int, dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The table's memory: its entries and the OrderedDict that holds them."""
        return self._entry_bytes + sys.getsizeof(self._entries)

    def _keys(self, tail: Sequence[int]) -> list[int]:
        """Keys of the n-grams ending ``tail``, orders ``1..min(len(tail), max_order)``."""
        keys, packed, bits = [], 0, self.bits
        for n in range(1, min(len(tail), self.config.max_order) + 1):
            packed |= tail[-n] << (bits * (n - 1))
            keys.append((n << (bits * n)) | packed)
        return keys

    def observe(self, tokens: Sequence[int], start: int = 0) -> None:
        """Count every follower ``tokens[i]``, ``i >= start``, after the n-grams that end at i-1."""
        lo = self.config.min_order
        for i in range(max(start, lo), len(tokens)):
            follower = tokens[i]
            for key in self._keys(tokens[max(0, i - self.config.max_order):i])[lo - 1:]:
                self._count(key, follower)
        self._evict()

    def _count(self, key: int, follower: int) -> None:
        entries = self._entries
        followers = entries.get(key)
        if followers is None:
            followers = entries[key] = {}
            before = -sys.getsizeof(key)
        else:
            entries.move_to_end(key)
            before = sys.getsizeof(followers) + _FOLLOWER_BYTES * len(followers)
        count = followers.pop(follower, 0) + 1  # re-inserted last: the newest follower is last
        if not count - 1 and len(followers) >= self.config.max_followers:
            del followers[min(followers, key=followers.__getitem__)]  # the rarest, oldest first
        followers[follower] = count
        self._entry_bytes += sys.getsizeof(followers) + _FOLLOWER_BYTES * len(followers) - before

    def _evict(self) -> None:
        if self.budget_bytes is None:
            return
        entries = self._entries
        while self.nbytes > self.budget_bytes and entries:
            key, followers = entries.popitem(last=False)
            self._entry_bytes -= (sys.getsizeof(key) + sys.getsizeof(followers)
                                  + _FOLLOWER_BYTES * len(followers))
            self.evictions += 1

    def followers(self, tail: Sequence[int]) -> dict[int, int] | None:
        """Followers of the longest n-gram ending ``tail`` that this table knows (order >=
        min_order), or None."""
        keys = self._keys(tail)
        for key in reversed(keys[self.config.min_order - 1:]):
            followers = self._entries.get(key)
            if followers:
                if self.budget_bytes is not None:
                    self._entries.move_to_end(key)  # a hit keeps it, as a sighting would
                return followers
        return None

    def feed_corpus(self, path: str, encode: Callable[[str], list[int]]) -> int:
        """Observe the n-grams of a text file, paragraph by paragraph (blank-line separated);
        ``encode(text) -> ids``. Returns the tokens read."""
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        read = 0
        for paragraph in text.split("\n\n"):
            if paragraph.strip():
                ids = [t for t in encode(paragraph) if 0 <= t < self.vocab_size]
                self.observe(ids)
                read += len(ids)
        return read


def shared_table(vocab_size: int, config: NgramConfig,
                 encode: Callable[[str], list[int]] | None = None) -> NgramTable | None:
    """A worker's shared table (None when ``table_mb`` is 0), warmed with ``config.corpus``."""
    if not config.budget_bytes:
        return None
    table = NgramTable(vocab_size, config, config.budget_bytes)
    if config.corpus is not None:
        if encode is None:
            raise InvalidArgument("a warm-start corpus needs a tokenizer")
        table.feed_corpus(config.corpus, encode)
    return table


def top_followers(followers: dict[int, int], k: int) -> tuple[list[int], list[float]]:
    """The ``k`` likeliest followers and their Witten-Bell log-probabilities; ties go to the most
    recently seen (``followers`` keeps the newest last)."""
    escape = sum(followers.values()) + len(followers)
    ranked = sorted(reversed(followers.items()), key=lambda item: item[1], reverse=True)[:k]
    return [t for t, _ in ranked], [math.log(c / escape) for _, c in ranked]


class Proposer:
    """One session's view of the n-gram statistics: its own table over its committed text, then
    the worker's shared table."""

    def __init__(self, vocab_size: int, config: NgramConfig, shared: NgramTable | None) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.shared = shared
        self.own = NgramTable(vocab_size, config)
        self.committed: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens: both tables learn the n-grams they complete."""
        if tokens and not (min(tokens) >= 0 and max(tokens) < self.vocab_size):
            raise InvalidArgument(f"a token id is outside the vocabulary [0, {self.vocab_size})")
        start = len(self.committed)
        self.committed.extend(tokens)
        # only the last max_order tokens before the new ones are needed as their context
        lo = max(0, start - self.config.max_order)
        window = self.committed[lo:]
        self.own.observe(window, start - lo)
        if self.shared is not None:
            self.shared.observe(window, start - lo)

    def tail(self, path: Sequence[int] = ()) -> tuple[int, ...]:
        """The last max_order tokens of the committed text followed by ``path``."""
        n = self.config.max_order
        return tuple((self.committed[-n:] + list(path))[-n:])

    def followers(self, tail: Sequence[int]) -> dict[int, int] | None:
        found = self.own.followers(tail)
        if found is None and self.shared is not None:
            found = self.shared.followers(tail)
        return found

    def chain(self, tail: Sequence[int], length: int, min_path_prob: float = 0.0) -> list[int]:
        """The likeliest continuation of ``tail``, up to ``length`` tokens (greedy, stops where
        nothing is known, or before the first token whose path score, the product of Witten-Bell
        probabilities, falls below ``min_path_prob``: the tree's chain rule)."""
        out: list[int] = []
        tail = list(tail)
        path = 1.0
        while len(out) < length:
            found = self.followers(tail)
            if not found:
                break
            token, count = max(reversed(found.items()), key=lambda item: item[1])  # ties: the newest
            path *= count / (sum(found.values()) + len(found))
            if path < min_path_prob:
                break
            out.append(token)
            tail = [*tail[1:], token] if len(tail) >= self.config.max_order else [*tail, token]
        return out


class PromptLookup:
    """Model-free chains from one session's own text alone (prompt lookup and suffix matching;
    no shared table, so no session's text ever shapes another's chains). What a CardSession
    offers when its tree has nothing to verify, e.g. right after a miss while the draft restarts
    (card.engine.shared.session.Lookup). Costs a few dict probes a token."""

    def __init__(self, vocab_size: int, config: NgramConfig | None = None) -> None:
        self.vocab_size = vocab_size
        self.config = config or NgramConfig(table_mb=0.0)
        self.proposer = Proposer(vocab_size, self.config, None)

    @property
    def text(self) -> list[int]:
        """The tokens read so far (the committed text)."""
        return self.proposer.committed

    def open(self, committed: Sequence[int]) -> None:
        """Read ``committed`` from scratch, or only its rest where this lookup has read a prefix of
        it (a conversation's earlier turn, handed on by the cache): the tables are the same either
        way, since ``extend`` is incremental and a session's own table evicts nothing."""
        known = self.proposer.committed
        if len(known) > len(committed) or list(committed[:len(known)]) != known:
            self.proposer = Proposer(self.vocab_size, self.config, None)
        self.proposer.extend(committed[len(self.proposer.committed):])

    def extend(self, tokens: Sequence[int]) -> None:
        self.proposer.extend(tokens)

    def continuation(self, length: int, min_path_prob: float = 0.0) -> tuple[int, ...]:
        return tuple(self.proposer.chain(self.proposer.tail(), length, min_path_prob))
