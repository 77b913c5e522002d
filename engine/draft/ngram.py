"""Model-free drafting: candidate trees from n-gram statistics, for the price of a few dict probes.

Glossary, as used here:
    context       the tokens before a tree node: the session's committed text (prompt and what the
                  target committed), then the path from the root to the node. Only its last
                  ``max_order`` tokens (the node's *tail*) matter.
    order n       a match of the context's last n tokens, ``min_order <= n <= max_order``.
    followers     the tokens seen after an n-gram, with their counts (at most ``max_followers``
                  per n-gram; the rarest gives way).
    session table followers of every n-gram of one session's own committed text: prompt lookup
                  and suffix matching, the most local source (code being edited, a document being
                  summarised, the first turn's answer).
    shared table  one per worker, fed with the committed text of every session it serves and an
                  optional warm-start corpus; least recently used n-grams are evicted to keep it
                  within a byte budget (``NgramConfig.table_mb``).

Hierarchy (Hierarchy Drafting's order of locality): a node's children come from the longest order
the session table knows, else the longest the shared table knows, else the node has none.
Branch scores are empirical frequencies with Witten-Bell's escape mass,
``p(t) = c(t) / (N + T)`` (N the followers' total count, T how many distinct followers there are):
one sighting scores 1/2, ten agreeing ones 10/11. Path scores therefore stay probabilities, so
tier C (global top-K by path score), tier B (top-k per node) and the target's chain rules
(``min_path_prob``) keep their meaning.

``NgramDrafter`` grows a session's two-tier tree from these tables layer by layer, exactly the
``Layer`` messages a neural drafter publishes, so the cache and the target do not know which kind
of draft they serve. ``Proposer.chain`` is what a neural drafter's cascade asks (card.engine.draft.drafter):
the likeliest continuation of a node, which the neural draft then checks in its own forward.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from card.engine.shared.config import ChainDraw, NgramConfig, TreeParams
from card.engine.shared.errors import Aborted, InvalidArgument, ResourceExhausted
from card.engine.shared.tree import Advance, Layer, TwoTierTree

_CPU = torch.device("cpu")
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

    def feed_corpus(self, path: str, encode: object) -> int:
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


def shared_table(vocab_size: int, config: NgramConfig, encode: object = None) -> NgramTable | None:
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

    def open(self, committed: Sequence[int]) -> None:
        self.proposer = Proposer(self.vocab_size, self.config, None)
        self.proposer.extend(committed)

    def extend(self, tokens: Sequence[int]) -> None:
        self.proposer.extend(tokens)

    def continuation(self, length: int, min_path_prob: float = 0.0) -> tuple[int, ...]:
        return tuple(self.proposer.chain(self.proposer.tail(), length, min_path_prob))


class NgramDrafter:
    """One session of the model-free drafter: the same life cycle as card.engine.draft.drafter.Drafter
    (start, plan, advance, release), with no model and no KV cache. ``plan`` always returns a
    ready ``Layer`` (or None: the tree is at max depth, or its deepest nodes have no known
    followers), so a worker never runs a forward for it."""

    forwards = 0  # it never runs one

    def __init__(self, params: TreeParams, vocab_size: int, config: NgramConfig,
                 shared: NgramTable | None, max_len: int) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.config = config
        self.shared = shared
        self.max_len = max_len
        self.tree = TwoTierTree(_CPU)
        self.proposer: Proposer | None = None
        self.next_id = 0
        self._tails: dict[int, tuple[int, ...]] = {}  # node id (the root's too) -> its tail
        self._open: set[int] = set()  # nodes to expand next: the newest layer, or the root

    @property
    def epoch(self) -> int:
        return self.tree.epoch

    def kv_length(self) -> int:
        return 0

    def start(self, committed: Sequence[int], epoch: int = 0, draw: ChainDraw | None = None) -> None:
        """``draw`` is taken and left: the statistics' counts are no distribution to draw from,
        so a rejection session's chains are drawn by the cache (TwoTierTree.drawn_chain)."""
        if len(committed) > self.max_len:
            raise ResourceExhausted(f"the session has {len(committed)} committed tokens, the draft takes "
                                    f"{self.max_len} (card-draft --max-model-len)")
        self.proposer = Proposer(self.vocab_size, self.config, self.shared)
        self.proposer.extend(committed)
        self.tree.reset(epoch)
        self._reopen_root()

    def _reopen_root(self) -> None:
        assert self.proposer is not None
        self._tails = {self.tree.root_id: self.proposer.tail()}
        self._open = {self.tree.root_id}

    def release(self) -> None:
        self.proposer = None
        self._tails, self._open = {}, set()
        self.tree.reset(self.tree.epoch)

    def plan(self) -> Layer | None:
        """The next layer: every open node's top-k followers (tier B), the K best by path score
        (tier C). The loop runs over the <= K open nodes, each a few dict probes; tensors would
        cost more than the lookups they wrap."""
        if self.proposer is None or not self._open:
            return None
        tree = self.tree
        known = dict(zip(tree.ids.tolist(), zip(tree.depth.tolist(), tree.path_logp.tolist(),
                                                strict=True), strict=True))
        known[tree.root_id] = (0, 0.0)
        parents: list[int] = []
        tokens: list[int] = []
        local: list[float] = []
        path: list[float] = []
        tails: list[tuple[int, ...]] = []
        for node in sorted(self._open):
            depth, node_path = known[node]
            if depth >= self.params.max_depth:
                continue
            tail = self._tails[node]
            found = self.proposer.followers(tail)
            if not found:
                continue
            toks, logps = top_followers(found, self.params.k)
            for t, lp in zip(toks, logps, strict=True):
                parents.append(node)
                tokens.append(t)
                local.append(lp)
                path.append(node_path + lp)
                keep = tail[1 - self.config.max_order:] if self.config.max_order > 1 else ()
                tails.append((*keep, t))
        self._open = set()
        if not tokens:
            return None
        order = sorted(range(len(path)), key=lambda i: -path[i])[: self.params.width]
        order.sort()  # by parent, then by rank: the order a neural drafter publishes in
        ids = list(range(self.next_id, self.next_id + len(order)))
        self.next_id += len(order)
        layer = Layer(
            torch.tensor([parents[i] for i in order], dtype=torch.int64),
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor([tokens[i] for i in order], dtype=torch.int64),
            torch.tensor([local[i] for i in order], dtype=torch.float32),
            torch.tensor(parents, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(local, dtype=torch.float32), epoch=tree.epoch)
        tree.apply_layer(layer)
        for nid, i in zip(ids, order, strict=True):
            self._tails[nid] = tails[i]
        self._open = set(ids)
        return layer

    def advance(self, adv: Advance) -> None:
        """The cache's verdict: re-root the mirror, learn the committed tokens, reopen."""
        if adv.epoch <= self.tree.epoch:
            return
        if adv.epoch != self.tree.epoch + 1:
            raise Aborted(f"drafter at epoch {self.tree.epoch} got advance to epoch {adv.epoch}")
        assert self.proposer is not None
        new_tokens = [*adv.accepted_tokens, adv.next_token]
        if len(self.proposer.committed) + len(new_tokens) > self.max_len:
            raise ResourceExhausted(f"the session outgrew the draft's {self.max_len} tokens")
        self.tree.reroot(adv)
        self.proposer.extend(new_tokens)
        if adv.hit_node_id is None:
            self._reopen_root()
            return
        # below the hit: grow on from every leaf (the newest layer's survivors, and nodes whose
        # children were all pruned out of tier C, which regrow among themselves)
        alive = set(self.tree.ids.tolist())
        alive.add(self.tree.root_id)
        self._tails = {nid: tail for nid, tail in self._tails.items() if nid in alive}
        self._open = alive - set(self.tree.parents.tolist())
