"""Which KV rows of a slot pool hold a known token prefix: the index of prefix caching, for the
target's pool and every draft worker's alike (one owner: card.engine.shared.kv_pool.KVPool keeps
one per pool and keeps it true; nothing else writes it).

Blocks, as in vLLM's KVCacheManager: a slot's rows are cut into blocks of ``block`` tokens
(PREFIX_BLOCK, 16, vLLM's default), block i at rows [i*block, (i+1)*block). A block is addressed
by the hash of (its parent block's hash, its tokens), so one hash names the whole prefix up to the
block's end, and a prompt's longest cached prefix is the deepest hash of its chain found in the
index (SGLang's RadixCache finds the same thing by walking a radix tree of tokens). sha256 makes a
collision as good as impossible, and a hit is still checked token for token against what the slot
holds before it is used: a wrong hit would break the exactness promise, not only the speed.

What is indexed: a slot's blocks from row 0 on, each one whole, once the caller says its rows are
final (``computed``): the target's prompt chunks as they are prefilled, and when a session ends
the rows it decoded too, where the target's prefill gives a decoding row's bits (its exact
prefill, card.engine.target.scheduler); a draft's prompt chunks, and when a draft session ends
the rows of the text it followed (grown as tree nodes: another arithmetic than a prefill's, so
those blocks are *loose*, ``exact=False``). Where a prompt's bits depend on its chunking (the
vendor attention) and its bits matter (the target's; a drawn draft session's), a match is taken
in whole prefill chunks only (``multiple``) and over exact blocks only (``exact_only``): a slot's
blocks are exact up to its first loose one (the rows after it attended to loose rows).
Anything that writes a row of a slot drops that slot's blocks from that row on (``truncate``): a
slot taken for another sequence, a session's rows past its prompt, a draft's moved rows. The index
is therefore bounded by slots x blocks per slot, and never outlives the rows it names.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass

# Tokens per prefix-cache block (vLLM's default block size): the index's granularity. A prompt
# reuses whole blocks where its rows' bits do not depend on its chunking (the target's exact
# prefill, KVPool.prefill_invariant), else whole prefill chunks only (KVPool.acquire_prefix).
PREFIX_BLOCK = 16
ROOT = b"card-prefix-root"  # the parent hash of a sequence's first block


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block: its parent's hash and its tokens (vLLM's hash_block_tokens)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def chain(tokens: Sequence[int], block: int, blocks: int | None = None) -> list[bytes]:
    """The hashes of the first ``blocks`` whole blocks of ``tokens`` (all of them: None)."""
    n = len(tokens) // block if blocks is None else min(blocks, len(tokens) // block)
    out: list[bytes] = []
    parent = ROOT
    for i in range(n):
        parent = block_hash(parent, tokens[i * block:(i + 1) * block])
        out.append(parent)
    return out


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a sequence: ``blocks`` whole blocks at the front of ``slot``."""

    slot: int
    blocks: int


class PrefixCache:
    """The index of one pool of ``slots`` slots of at most ``max_rows`` rows, in blocks of
    ``block`` tokens. Counters: ``queries`` (tokens looked up) and ``hits`` (of them, found),
    vLLM's prefix_cache_queries / prefix_cache_hits."""

    def __init__(self, slots: int, block: int, max_rows: int) -> None:
        if block < 1:
            raise ValueError(f"a prefix block needs >= 1 token, got {block}")
        self.block = block
        self.max_blocks = max_rows // block
        self._held: list[list[bytes]] = [[] for _ in range(slots)]  # per slot: its blocks' hashes
        self._tokens: list[list[int]] = [[] for _ in range(slots)]  # per slot: the tokens they hold
        self._exact: list[int] = [0] * slots  # per slot: its leading blocks that are a prefill's bits
        self._index: dict[bytes, dict[int, None]] = {}  # block hash -> the slots holding it (ordered)
        self.queries = 0
        self.hits = 0

    # ---- reading ------------------------------------------------------------------------------
    def rows(self, slot: int) -> int:
        """Rows at the front of ``slot`` that indexed blocks cover."""
        return len(self._held[slot]) * self.block

    @property
    def entries(self) -> int:
        """(block, slot) pairs indexed: at most slots x max_blocks."""
        return sum(len(h) for h in self._held)

    def exact_blocks(self, slot: int) -> int:
        """Leading blocks of ``slot`` whose rows are a prefill's bits (the rest are loose)."""
        return self._exact[slot]

    def match(self, tokens: Sequence[int], free: Collection[int] = (), multiple: int = 1,
              exact_only: bool = True) -> Match | None:
        """The longest cached whole-block prefix of ``tokens`` that leaves at least one token
        to compute (a prompt's last token's logits are needed), in a whole ``multiple`` of blocks,
        None if no block is cached; ``exact_only``: over blocks that are a prefill's bits alone.
        Of the slots holding it, a ``free`` one first, the one holding the fewest blocks past it
        (taken as it is where it holds none, KVPool.acquire_prefix)."""
        limit = min((len(tokens) - 1) // self.block, self.max_blocks)
        holders: list[dict[int, None]] = []  # per depth, the slots holding the prefix to there
        parent = ROOT
        for i in range(limit):
            parent = block_hash(parent, tokens[i * self.block:(i + 1) * self.block])
            found = self._index.get(parent)
            if found and exact_only:
                found = {s: None for s in found if self._exact[s] > i}
            if not found:
                break
            holders.append(found)
        blocks = len(holders) - len(holders) % multiple
        if not blocks:
            return None
        # a hash is trusted only once the tokens agree (exactness does not rest on sha256)
        end = blocks * self.block
        prefix = list(tokens[:end])
        agree = [s for s in holders[blocks - 1] if self._tokens[s][:end] == prefix]
        if not agree:
            return None
        free_holders = [s for s in agree if s in free]
        if free_holders:
            return Match(min(free_holders, key=lambda s: len(self._held[s])), blocks)
        return Match(agree[0], blocks)

    def record(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    # ---- keeping it true ------------------------------------------------------------------------
    def computed(self, slot: int, start: int, tokens: Sequence[int], exact: bool = True) -> None:
        """Rows [start, start+len(tokens)) of ``slot`` now hold the final keys and values of
        ``tokens`` after the slot's earlier rows: index the whole blocks among them that extend
        the slot's indexed prefix (rows after a gap, or a partial block, are not indexed).
        ``exact``: a prefill's bits (after exact blocks only do they count as exact)."""
        held, mine = self._held[slot], self._tokens[slot]
        extends_exact = exact and self._exact[slot] == len(held)
        if start != len(held) * self.block:
            return
        for i in range(len(tokens) // self.block):
            if len(held) >= self.max_blocks:
                break
            part = list(tokens[i * self.block:(i + 1) * self.block])
            h = block_hash(held[-1] if held else ROOT, part)
            held.append(h)
            mine += part
            self._index.setdefault(h, {})[slot] = None
        if extends_exact:
            self._exact[slot] = len(held)

    def truncate(self, slot: int, rows: int) -> None:
        """Rows from ``rows`` on of ``slot`` are to be overwritten: drop its blocks that reach them."""
        held = self._held[slot]
        keep = max(rows, 0) // self.block
        if keep >= len(held):
            return
        for h in held[keep:]:
            holders = self._index[h]
            del holders[slot]
            if not holders:
                del self._index[h]
        del held[keep:]
        del self._tokens[slot][keep * self.block:]
        self._exact[slot] = min(self._exact[slot], keep)

    def copied(self, src: int, dst: int, blocks: int) -> None:
        """``dst`` now holds the first ``blocks`` blocks of ``src`` (its rows were copied; the
        caller has truncated ``dst`` to nothing first)."""
        assert not self._held[dst], "copy into a slot that still holds blocks"
        hashes = self._held[src][:blocks]
        self._held[dst] = list(hashes)
        self._tokens[dst] = self._tokens[src][:blocks * self.block]
        self._exact[dst] = min(self._exact[src], blocks)
        for h in hashes:
            self._index[h][dst] = None
