"""Which draft worker served a conversation's earlier turn: its next turn goes back there.

Why: a draft worker keeps a finished session's keys and values in its pool, indexed by block
(card.engine.shared.prefix_cache), until it needs the slot. A conversation's next turn (the
earlier prompt, its answer, a new message) served by that worker prefills only the new message
before it drafts; served by another, it prefills the whole conversation first, and the target
waits on a draft that is still reading. So a session is placed on the worker whose earlier session
its prompt extends, as SGLang's cache-aware router sends a request to the worker holding its
longest prefix, while that worker is not much busier than the least-loaded one
(card.cache_service.assignment.AFFINITY_SLACK): affinity never outweighs balance by more.

What is kept: for each recently closed session, an entry keyed by (tokenizer fingerprint, the
hash chain of its text's whole PREFIX_BLOCKs: card.engine.shared.prefix_cache.chain, the draft's
own block hashing) -> the worker's id, and another at its prompt's last whole block. A new
prompt's chain is looked up from its deepest block down; the deepest entry found names the
worker. Bounded: at most ``entries`` entries, least recently used first out; a session's tokens
are not kept, only two hashes. A hit is a preference, never a correctness matter: the worker
checks its own cached rows token for token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from card.engine.shared.prefix_cache import PREFIX_BLOCK, chain

AFFINITY_ENTRIES = 4096  # closed sessions remembered (a hash and a worker id each)


class TurnAffinity:
    """Closed sessions' texts (as block-hash chains) -> the worker that served them. Thread-safe
    (one leaf lock: nothing waits under it)."""

    def __init__(self, entries: int = AFFINITY_ENTRIES, block: int = PREFIX_BLOCK) -> None:
        self.entries = entries
        self.block = block
        self._lock = threading.Lock()
        self._held: OrderedDict[tuple[str, bytes], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def put(self, fingerprint: str, text: Sequence[int], worker_id: str, prompt_tokens: int = 0) -> None:
        """Session text ``text`` (its prompt and answer) was last drafted by ``worker_id``: kept
        under its whole-block end and, where the prompt ends in another block, the prompt's (a
        next turn re-renders the earlier messages, but the answer's last tokens may come out of
        the chat template otherwise). A text shorter than one block is not kept (no block of it
        is cached either)."""
        hashes = chain(text, self.block)
        ends = {len(hashes), min(prompt_tokens // self.block, len(hashes))} - {0}
        with self._lock:
            for end in sorted(ends):
                key = (fingerprint, hashes[end - 1])
                self._held[key] = worker_id
                self._held.move_to_end(key)
            while len(self._held) > self.entries:
                self._held.popitem(last=False)

    def prefer(self, fingerprint: str, prompt: Sequence[int]) -> str:
        """The worker that served the closed session whose whole-block text is the longest prefix
        of ``prompt``; "" if none."""
        hashes = chain(prompt, self.block)
        with self._lock:
            for h in reversed(hashes):
                worker_id = self._held.get((fingerprint, h))
                if worker_id is not None:
                    self._held.move_to_end((fingerprint, h))
                    return worker_id
        return ""
