"""The KV cache of a model serving many sessions, and its one forward: allocated once, written
by index. The target (engine.target.scheduler) and the draft worker (engine.draft.worker) both run
on it.

    keys[layer], values[layer]: [slots, kv_heads, max_len rounded up to whole KV_BLOCKs, head_dim]

A session owns one slot while it lives (gpt-fast's static cache, with a slot dimension). A forward
runs the new tokens of every session in the iteration as one flattened row of ``T`` tokens
(vLLM / nano-vllm's layout): every linear layer, norm and rotary embedding sees ``[T, hidden]``, and
only attention is per session, over that session's own slot. Each token's key and value are
written at ``(slot, row)``; no concatenation, nothing allocated per step.

Target segments are causal: row = position, a query sees rows <= its own, so accepting a chain
keeps its rows where they are and rejected rows are junk the next forward overwrites. Draft tree
segments carry their own rotary ``positions`` (a node at depth d sits at position committed-1+d,
whatever row it is written to) and a ``visible`` mask (its ancestors and itself, card.engine.draft.drafter);
after a correction the drafter moves the rows it keeps to the front (``KVPool.keep``).

Exactness under batching: a session's attention has the same shapes and inputs whatever runs
beside it, and the CPU's prepacked linears (card.engine.loading.cpu_linear) are row-invariant, so a
session's logits do not depend on its neighbours. No padding exists to change a value.

Prefix caching (``prefix_caching=True``, card.engine.shared.prefix_cache): a released slot keeps
its rows, and the whole PREFIX_BLOCKs among them its owner said are final (``computed``,
``settled``) stay indexed by their token prefix until the slot is taken again (free slots in LRU
order); ``acquire_prefix`` gives a new sequence the slot holding its longest cached prefix (in
whole prefill chunks where the owner's prompt rows depend on their chunking), or copies those
rows from a live session's slot. Every write says which rows it overwrites first (``written``),
so the index never names a changed row.

Supported: decoder-only models whose ``*ForCausalLM`` is ``model.embed_tokens / layers / norm /
rotary_emb`` + ``lm_head`` and whose model forward does nothing else (``MODEL_TYPES``: Llama,
Mistral (with a sliding window, up to its length: loading.models.context_window_of), Qwen2,
Qwen3), the families the tree attention of the drafter supports too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from card.engine.shared.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from card.engine.shared.exact_attention import (
    KV_BLOCK,
    RowPlan,
    Rows,
    attend_blocks,
    attend_rows,
    batched_is_invariant,
    blocks_are_invariant,
    pow2_blocks,
    span,
    tree_attention,
)
from card.engine.shared.hf import CACHE_KEYWORD, CausalLM, cache_keyword
from card.engine.shared.lean_layers import lean_layers
from card.engine.shared.pages import release_pages
from card.engine.shared.prefix_cache import PREFIX_BLOCK, PrefixCache
from card.engine.shared.row_attention import RowKernel, setting_of, use_kernel

ATTN = "card_slots"

# Rows per slot a default --max-model-len never goes below to keep --max-batch-size slots in a
# KV budget too small for the whole context window (pool_shape): below this, fewer slots instead.
SHORTEST_DEFAULT_LEN = 4096

# On an accelerator without --kv-cache-gb, the KV cache may take this share of the memory free once
# the model is loaded (the rest: activations, CUDA graphs, the static step's buffers). It takes
# only what its slots need: the budget caps a large --max-batch-size x context window.
DEVICE_KV_SHARE = 0.8

# Prompt tokens per prefill chunk. Fixed for every entry point: where prompts take SDPA (CUDA,
# --exact off, drafts) the chunking is part of a generation's arithmetic (in-process reference runs
# and card-target must chunk alike; an exact CPU prefill's bits do not depend on it), and a long
# prompt in chunks does not stall the sessions decoding beside it (target and draft alike).
PREFILL_CHUNK = 256

# With prefix caching, slots that hold finished sequences only (for later prompts: a chat's next
# turn, an agent's next call) beside each slot a live sequence may hold; fewer where a KV budget
# holds fewer (size_pool). On the CPU such slots cost address space until written, and what they
# keep resident is bounded in bytes (KVPool.cache_bytes, --prefix-cache-gb).
CACHED_PER_SLOT = 4



@dataclass(frozen=True, eq=False)
class Segment:
    """One session's part of a forward: ``length`` tokens written at rows ``start...`` of ``slot``.

    positions: [length] rotary positions; None = the rows (start, start+1, ...).
    visible:   [length, start+length] bool, the rows each query attends to (a draft's tree rows:
               SDPA per segment, or with ``KVPool.tree_blocks`` the block tree,
               card.engine.shared.exact_attention.tree_attention, whose result for a row does not
               depend on the segment's shape); None = causal (every row up to the query's own).
    exact:     causal rows whose attention must not depend on the segment's length (the target's
               decoding rows): card.engine.shared.exact_attention instead of SDPA.
    prefill:   with ``exact``, a prompt's rows: exact_attention.attend_blocks, a KV block of rows
               per matmul, the bits of ``exact`` rows where ``KVPool.prefill_invariant`` (the
               target's prompts, so that any cached row is reusable, card.engine.target.scheduler).
    """

    slot: int
    start: int
    length: int
    positions: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    exact: bool = False
    prefill: bool = False

    @property
    def end(self) -> int:
        return self.start + self.length


class KVPool:
    """Preallocated keys and values for ``slots`` sessions of at most ``max_len`` tokens each."""

    def __init__(self, model: CausalLM, slots: int, max_len: int, prefix_caching: bool = False,
                 cached_slots: int = 0, cache_bytes: int | None = None) -> None:
        if slots < 1 or max_len < 2:
            raise ResourceExhausted(f"a KV cache needs >= 1 slot of >= 2 tokens, got {slots} x {max_len}")
        if cached_slots < 0 or (cached_slots and not prefix_caching):
            raise InvalidArgument(f"cached slots need prefix caching and a count >= 0, got {cached_slots}")
        if cache_bytes is not None and cache_bytes < 0:
            raise InvalidArgument(f"a prefix cache's memory bound must be >= 0, got {cache_bytes}")
        enable(model)
        cfg = model.config
        param = next(model.parameters())
        kv_heads, head_dim = _kv_shape(cfg)
        dtype = _kv_dtype(model)
        layers = range(cfg.num_hidden_layers)
        # whole KV_BLOCKs per slot: exact attention reads a row's span, rounded up to a block
        # one slot more than sessions get: the scratch slot, where a static step's ghost rows write
        # (card.engine.shared.static_step), zeroed by the step that uses it (zero_scratch); the
        # budget (pool_shape) counts it
        # ``cached_slots`` more than that hold finished sequences only, for later prompts (prefix
        # caching past the live sessions: vLLM keeps cached blocks while its KV memory lasts)
        total = slots + cached_slots
        shape = (total + 1, kv_heads, span(max_len - 1), head_dim)
        # torch.empty on the CPU: pages become resident only when a session first writes them, so
        # a generous max_len costs address space, not memory. No query reads an unwritten row
        # unmasked (exact attention zeroes the junk rows of its span first). Zeros elsewhere: a
        # GPU allocation may hold anything.
        alloc = torch.empty if param.device.type == "cpu" else torch.zeros
        self.keys = [alloc(shape, dtype=dtype, device=param.device) for _ in layers]
        self.values = [alloc(shape, dtype=dtype, device=param.device) for _ in layers]
        self.slots = slots  # sequences held at once (sessions); ``free_slots`` counts against it
        self.cached_slots = cached_slots
        self.scratch = total
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.bytes_per_row = 2 * len(layers) * kv_heads * head_dim * itemsize  # every layer's keys + values
        # on the CPU, where a written page stays resident: the bytes of rows that free slots may keep
        # (KVPool._bound_cache gives the least recently used ones' pages back past it); None: no bound
        # (a budget that paid for every slot up front: an accelerator, --kv-cache-gb)
        self.cache_bytes = cache_bytes
        self.evictions = 0  # free slots whose rows were given back to bound the cache's memory
        # tree segments (Segment.visible) through the block tree (exact_attention.tree_attention,
        # whose result for a row does not depend on the forward's shape) rather than SDPA per
        # session: set by the draft's static tree step (card.engine.draft.static_tree), so that its
        # rounds and any eager round beside them share one arithmetic. Off by default: on the CPU
        # the block tree gives 0.21x of SDPA's draft rounds/s at 8 sessions (docs/performance.md)
        self.tree_blocks = False
        self.max_len = max_len
        self.device = param.device
        heads = cfg.num_attention_heads
        # every exact row (decoding, verifying, prefilling) and every tree row through the C kernel
        # where it runs (card.engine.shared.row_attention): row-invariant by construction, so batched
        # and prompt rows have decoding rows' bits without the torch paths' probes; decided here,
        # in the thread that builds the pool, not in a serving thread
        self._attention = (setting_of(model), param.device, dtype, kv_heads, heads // kv_heads, head_dim)
        self.row_kernel = use_kernel(*self._attention)
        self._scratch_zeroed = param.device.type != "cpu"  # torch.zeros above
        # free slots; with prefix caching in release order (the front: released longest ago, the
        # LRU victim), else a stack (the slot released last is taken first: its pages are resident)
        self._free = list(range(total)) if prefix_caching else list(range(total - 1, -1, -1))
        self._ready = [0] * total  # per slot: rows below this hold finite values (KVPool.ready)
        self._touched = [0] * total  # per slot: rows below this may be resident (written or zeroed)
        # prefix caching (card.engine.shared.prefix_cache): which rows hold which token prefix; a
        # free slot keeps its rows and its blocks until it is taken again
        self.prefix = PrefixCache(total, PREFIX_BLOCK, max_len) if prefix_caching else None

    @functools.cached_property
    def batched_exact(self) -> bool:
        """Many sessions' exact decoding rows in one call give each the bits it gets alone here
        (probed when first asked, which a pool without exact rows, a draft's, never does)."""
        return self.row_kernel or batched_is_invariant(*self._attention[1:])

    @functools.cached_property
    def prefill_invariant(self) -> bool:
        """A prompt's rows through exact_attention.attend_blocks (or the kernel) get a decoding row's
        bits here: an exact engine prefills that way, and any cached row is then reusable
        (TargetEngine)."""
        return self.row_kernel or blocks_are_invariant(*self._attention[1:])

    def zero_scratch(self) -> None:
        """Zero the scratch slot (once): ghost rows read its keys and values under a mask, and a
        masked NaN still poisons a softmax. Done by the static step that uses it, not at start-up:
        on the CPU the pool is torch.empty, and an eager engine never makes these pages resident."""
        if not self._scratch_zeroed:
            for t in (*self.keys, *self.values):
                t[self.scratch].zero_()
            self._scratch_zeroed = True

    @staticmethod
    def bytes_per_token(model: CausalLM) -> int:
        """Keys and values of one token over every layer."""
        kv_heads, head_dim = _kv_shape(model.config)
        itemsize = torch.empty(0, dtype=_kv_dtype(model)).element_size()
        return 2 * model.config.num_hidden_layers * kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def free_slots(self) -> int:
        """Sequences that may start now: ``slots`` less the ones held (the cached slots are room for
        finished sequences, not for more at once)."""
        return len(self._free) - self.cached_slots

    @property
    def cached_rows(self) -> int:
        """Rows that free slots may keep resident (their high-water marks): what ``cache_bytes``
        bounds, in rows of ``bytes_per_row``."""
        return sum(self._touched[s] for s in self._free)

    def acquire(self) -> int | None:
        """A free slot for a new sequence (its cached blocks, if any, are dropped): the LRU one
        with prefix caching."""
        if self.free_slots <= 0:
            return None
        if self.prefix is None:
            slot = self._free.pop()
        else:
            slot = self._victim()
            self._free.remove(slot)
            self.prefix.truncate(slot, 0)
        self._ready[slot] = 0  # rows past the new session's writes: whatever the last one left
        return slot

    def _victim(self, spare: int | None = None) -> int:
        """The free slot a new sequence takes (but ``spare``, which must not be the only one): one
        that caches nothing first, else the one released longest ago (LRU)."""
        assert self.prefix is not None
        rows = self.prefix.rows
        free = [s for s in self._free if s != spare]
        return next((s for s in free if not rows(s)), free[0])

    def acquire_prefix(self, tokens: Sequence[int], granularity: int = PREFIX_BLOCK,
                       exact_only: bool = True) -> tuple[int, int] | None:
        """A free slot for a sequence that starts with ``tokens`` and how many of its first rows
        already hold their keys and values (whole prefix blocks, in whole multiples of
        ``granularity`` rows: a prefill chunk where a prompt's bits depend on its chunking; at
        least one token left to compute; ``exact_only=False``: loose blocks too, a draft's rows of
        a text it followed, for a sequence whose numbers need not be a cold prefill's), or None
        when no slot is free. The longest cached
        prefix is taken where it is when a free slot holds it and nothing more (no copy); else its
        rows are copied (every layer, keys and values: the same bits) from the slot holding it,
        live or free, into the slot ``acquire`` would take, so that a shared prefix (a system
        prompt) never costs another finished sequence its blocks. Without prefix caching:
        (slot, 0)."""
        if self.free_slots <= 0:
            return None
        if self.prefix is None:
            slot = self.acquire()
            assert slot is not None
            return slot, 0
        match = self.prefix.match(tokens, self._free, -(-granularity // self.prefix.block), exact_only)
        if match is not None and match.slot in self._free and (
                self.prefix.rows(match.slot) == match.blocks * self.prefix.block or len(self._free) == 1):
            slot = match.slot
            self._free.remove(slot)
            self._ready[slot] = 0
        else:
            slot = self._victim(spare=match.slot if match is not None else None)
            self._free.remove(slot)
            self.prefix.truncate(slot, 0)
            self._ready[slot] = 0
        rows = 0
        if match is not None:
            rows = match.blocks * self.prefix.block
            if match.slot != slot:
                self.copy_rows(match.slot, slot, rows)
                self.prefix.copied(match.slot, slot, match.blocks)
            else:
                self.prefix.truncate(slot, rows)  # its blocks past the match are rewritten
        self.prefix.record(len(tokens), rows)
        return slot, rows

    def copy_span(self, src: int, dst: int, start: int, end: int) -> None:
        """Rows [start, end) of slot ``src`` into the same rows of slot ``dst``, every layer, keys
        and values (``dst``'s blocks reaching them go first)."""
        self.written(dst, start, end)
        for t in (*self.keys, *self.values):
            t[dst, :, start:end] = t[src, :, start:end]

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Rows [0, rows) of slot ``src`` into slot ``dst``, every layer, keys and values."""
        self.written(dst, 0, rows)
        for t in (*self.keys, *self.values):
            t[dst, :, :rows] = t[src, :, :rows]

    def written(self, slot: int, start: int, end: int) -> None:
        """Rows [start, end) of ``slot`` are about to be written: its cached blocks that reach
        them go (every forward says so for each of its segments)."""
        if slot == self.scratch:
            return
        self._touched[slot] = max(self._touched[slot], end)
        if self.prefix is not None:
            self.prefix.truncate(slot, start)

    def computed(self, slot: int, start: int, tokens: Sequence[int], exact: bool = True) -> None:
        """Rows [start, start+len(tokens)) of ``slot`` hold the final keys and values of
        ``tokens`` computed by a prefill chunk: their whole blocks may be reused; ``exact``: they
        are the bits a cold prefill gives (else loose, prefix_cache)."""
        if self.prefix is not None:
            self.prefix.computed(slot, start, tokens, exact)

    def settled(self, slot: int, tokens: Sequence[int], exact: bool = True) -> None:
        """Rows [0, len(tokens)) of ``slot`` hold the final keys and values of ``tokens`` (a session
        ends: its prompt and what it decoded): index the whole blocks past the ones already
        indexed; ``exact``: they are a prefill's bits, else loose (a draft's tree rows)."""
        if self.prefix is not None:
            rows = self.prefix.rows(slot)
            self.prefix.computed(slot, rows, tokens[rows:], exact)

    def ready(self, slot: int, written: int, rows: int) -> None:
        """Make rows ``written...rows`` of ``slot`` finite before a query reads them masked
        (exact attention reads whole spans; a never-written row of torch.empty may hold NaN, and
        NaN + -inf or 0 * NaN is NaN): zeroed once, the first time a session's span reaches them;
        rows below ``written`` hold the session's keys and values."""
        if rows <= self._ready[slot]:
            return
        first = max(written, self._ready[slot])
        for t in (*self.keys, *self.values):
            t[slot, :, first:rows] = 0
        self._ready[slot] = rows
        self._touched[slot] = max(self._touched[slot], rows)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.scratch or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)
        self._bound_cache()

    def _bound_cache(self) -> None:
        """Past ``cache_bytes`` of rows kept by free slots, give the least recently used ones'
        pages back (their blocks go first): memory stays bounded however many sequences pass,
        and a slot given back is resident again only as its next sequence writes it."""
        if self.cache_bytes is None or self.prefix is None:  # no cache: free slots keep nothing of use
            return
        kept = self.cached_rows * self.bytes_per_row
        if kept <= self.cache_bytes:
            return
        rows = self.prefix.rows
        # resident pages that cache nothing first, then cached sequences, least recently used first
        order = sorted((s for s in self._free if self._touched[s]), key=lambda s: rows(s) > 0)
        for slot in order:
            if kept <= self.cache_bytes:
                return
            kept -= self._touched[slot] * self.bytes_per_row
            self.drop(slot)

    def drop(self, slot: int) -> None:
        """Forget a free slot's rows: its blocks leave the index and, on the CPU, its pages go back
        to the system (zero pages when next touched; rows are made finite again before a read)."""
        if slot not in self._free:
            raise ValueError(f"slot {slot} is held: only a free slot's rows can be dropped")
        if self.prefix is not None:
            self.prefix.truncate(slot, 0)
        if self.device.type == "cpu":
            for t in (*self.keys, *self.values):
                release_pages(t[slot])
        self._touched[slot] = 0
        self._ready[slot] = 0
        self.evictions += 1

    def keep(self, slot: int, first: int, rows: torch.Tensor) -> None:
        """Move ``rows`` [n] of ``slot`` (any order, any rows) to rows ``first...first+n-1``."""
        if not rows.numel():
            return
        end = first + rows.numel()
        self.written(slot, first, end)
        rows = rows.to(self.device)
        for t in (*self.keys, *self.values):
            t[slot, :, first:end] = t[slot, :, rows]  # the gather copies before the write


def check_sizing(kv_cache_gb: float | None, max_model_len: int | None,
                 memory_fraction: float = DEVICE_KV_SHARE) -> None:
    """The sizing flags every service with a KV cache takes (--kv-cache-gb, --max-model-len,
    --kv-cache-memory-fraction)."""
    if kv_cache_gb is not None and not kv_cache_gb > 0:
        raise InvalidArgument(f"kv-cache-gb must be > 0, got {kv_cache_gb}")
    if not 0 < memory_fraction <= 1:
        raise InvalidArgument(f"kv-cache-memory-fraction must be in (0, 1], got {memory_fraction}")
    if max_model_len is not None and max_model_len < 2:
        raise InvalidArgument(f"max-model-len must be >= 2, got {max_model_len}")


@dataclass(frozen=True)
class PoolShape:
    """What a KV cache holds: ``slots`` sequences of ``max_len`` tokens; ``why``: how that was
    chosen, for the one start-up line (``describe``)."""

    slots: int
    max_len: int
    why: str
    # prefix caching: slots beyond ``slots`` that keep finished sequences, and the bytes of rows
    # they may keep resident (None: the budget paid for them up front)
    cached_slots: int = 0
    cache_bytes: int | None = None

    def describe(self, nbytes: int) -> str:
        cached = ""
        if self.cached_slots:
            bound = ("within the KV budget" if self.cache_bytes is None
                     else f"at most {self.cache_bytes / 2**30:.2f} GB of them resident")
            cached = (f"; prefix caching keeps finished sequences in {self.cached_slots} more slots "
                      f"({bound})")
        return (f"KV cache: {self.slots} slots x {self.max_len} tokens ({nbytes / 2**30:.2f} GB): "
                f"{self.why}{cached}")


def device_free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device`` now (a CUDA device), None where a KV cache costs no real memory
    until it is written (the CPU: torch.empty, see KVPool)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def size_pool(max_slots: int, max_model_len: int | None, context_window: int, bytes_per_token: int,
              kv_cache_gb: float | None, extra_rows: int = 0, free_bytes: int | None = None,
              slots_flag: str = "--max-batch-size", memory_fraction: float = DEVICE_KV_SHARE,
              prefix_cache_gb: float | None = None) -> PoolShape:
    """The one sizing rule of card-target and card-draft (vLLM's, on static slots):

    - the budget: ``kv_cache_gb`` (--kv-cache-gb); else ``memory_fraction`` (--kv-cache-memory-
      fraction, DEVICE_KV_SHARE by default) of ``free_bytes`` (the accelerator's free memory once
      the model is loaded); else none (the CPU, where an unwritten row costs address space only);
    - tokens per slot: ``max_model_len`` (at most the context window); by default the model's whole
      context window where the budget holds ``max_slots`` sequences of it, else the longest length
      (whole KV_BLOCKs, at least SHORTEST_DEFAULT_LEN) at which it does;
    - slots: ``max_slots``, fewer where the budget holds fewer; none is an error that says what to
      change.

    The pool holds one slot more than sequences get (KVPool's scratch slot, where a static step's
    padding rows write): the budget pays for it too. Each slot also holds ``extra_rows`` (a draft's
    tree).

    ``prefix_cache_gb`` (prefix caching on): CACHED_PER_SLOT slots of finished sequences per slot
    beside them; with a budget, as many as it holds past the others (paid for up front), else
    (the CPU) keeping at most that many GB resident."""
    window = context_window
    if kv_cache_gb is not None:
        budget: int | None = int(kv_cache_gb * 2**30)
        source = f"--kv-cache-gb {kv_cache_gb:g}"
    elif free_bytes is not None:
        budget = int(free_bytes * memory_fraction)
        source = (f"{memory_fraction:.0%} of the {free_bytes / 2**30:.1f} GB free on the device; "
                  "--kv-cache-memory-fraction or --kv-cache-gb sets it")
    else:
        budget, source = None, ""

    def fits(length: int) -> int:  # sequences of ``length`` the budget holds beside the scratch slot
        return max_slots if budget is None else budget // (bytes_per_token * (length + extra_rows)) - 1

    hint = ""
    if max_model_len is not None:
        max_len = min(max_model_len, window)
        why = (f"--max-model-len {max_model_len}" if max_len == max_model_len
               else f"--max-model-len {max_model_len}, capped at the model's context window")
    elif fits(window) >= max_slots:
        max_len = window
        why = "the model's context window"
        if budget is None:
            why += " (no KV budget: on the CPU a row takes memory once written)"
    else:  # the whole window would cost slots: shorten it, down to SHORTEST_DEFAULT_LEN
        assert budget is not None
        longest = (budget // (bytes_per_token * (max_slots + 1)) - extra_rows) // KV_BLOCK * KV_BLOCK
        held = f"the model's context window, {window} tokens, would hold {max(fits(window), 0)}"
        if longest >= min(window, SHORTEST_DEFAULT_LEN):
            max_len = longest
            why = f"the longest length the KV budget holds {slots_flag} {max_slots} of ({held})"
        else:
            max_len = min(window, SHORTEST_DEFAULT_LEN)
            why = f"the shortest default length ({held})"
        hint = "; --max-model-len sets the length"
    slots = min(fits(max_len), max_slots)
    if slots < 1:
        per_slot = bytes_per_token * (max_len + extra_rows)
        where = f"--kv-cache-gb {kv_cache_gb:g}" if kv_cache_gb is not None else f"the KV budget ({source})"
        raise ResourceExhausted(
            f"{where} holds no sequence of {max_len} tokens beside the scratch slot "
            f"({per_slot / 2**30:.3f} GB each, two needed); raise it or lower --max-model-len")
    if slots < max_slots:
        why += f"; {slots} of {slots_flag} {max_slots} sequences fit"
    if budget is not None:
        why += f" (KV budget: {source})"
    why += hint
    cached, cache_bytes = 0, None
    if prefix_cache_gb:  # None, 0: none
        cached = CACHED_PER_SLOT * slots
        if budget is None:
            cache_bytes = int(prefix_cache_gb * 2**30)
        else:
            cached = max(0, min(cached, fits(max_len) - slots))
    return PoolShape(slots, max_len, why, cached, cache_bytes)


def pool_shape(max_slots: int, max_model_len: int | None, context_window: int, bytes_per_token: int,
               kv_cache_gb: float | None, extra_rows: int = 0,
               free_bytes: int | None = None) -> tuple[int, int]:
    """(slots, tokens per slot) by ``size_pool``'s rule."""
    shape = size_pool(max_slots, max_model_len, context_window, bytes_per_token, kv_cache_gb, extra_rows,
                      free_bytes)
    return shape.slots, shape.max_len


def _kv_shape(cfg: Any) -> tuple[int, int]:
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kv_heads, head_dim


def _kv_dtype(model: CausalLM) -> torch.dtype:
    # keys and values come out of the k/v projections in the activations' dtype: the embedding's
    return model.get_input_embeddings().weight.dtype


class _Batch:
    """What one forward's attention needs: handed to every layer as its KV cache (hf.CACHE_KEYWORD; its
    ``update`` writes the new keys and values in place) and as the ``card_batch`` keyword."""

    def __init__(self, pool: KVPool, segments: Sequence[Segment]) -> None:
        self.pool = pool
        self.segments = segments
        dev = pool.device
        for s in segments:
            pool.written(s.slot, s.start, s.end)
        self.slot_index = torch.cat(
            [torch.full((s.length,), s.slot, dtype=torch.int64) for s in segments]).to(dev)
        self.rows = torch.cat([torch.arange(s.start, s.end) for s in segments]).to(dev)
        self.positions = torch.cat([torch.arange(s.start, s.end) if s.positions is None else s.positions
                                    for s in segments]).to(dev)
        self.offsets = [0]
        for s in segments:
            self.offsets.append(self.offsets[-1] + s.length)
        # per segment: None (every row up to its end is visible to every query: one query, or a
        # causal block from row 0) or a boolean mask [length, end]
        self.tree = TreeRows.of(pool, segments, self.offsets) if pool.tree_blocks else None
        # every exact segment's rows in one call of the attention kernel (prompt rows too: the
        # kernel gives them decoding rows' bits), else in one batched attention where that is
        # invariant here; tree segments not on the block tree go to the kernel too (for speed: one
        # call instead of SDPA per session)
        placed = [(s, Rows(s.slot, s.start, s.length, q0))
                  for s, q0 in zip(segments, self.offsets, strict=False)]
        rows = [r for s, r in placed if s.exact]
        trees = [(r, s.visible) for s, r in placed if s.visible is not None and self.tree is None]
        self.kernel = RowKernel(rows, trees) if (rows or trees) and pool.row_kernel else None
        self.masks = [(None if self.tree is not None or self.kernel is not None else s.visible.to(dev))
                      if s.visible is not None
                      else None if s.length == 1 or s.exact else _causal(s, dev) for s in segments]
        exact = [r for s, r in placed if s.exact and not s.prefill]
        self.row_plan = None
        if exact and not pool.row_kernel and pool.batched_exact:
            for r in exact:
                pool.ready(r.slot, r.start + r.n, span(r.start + r.n - 1))
            self.row_plan = RowPlan(exact, dev)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs: object = None,
               **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers < 5.24 passes ``cache_kwargs``, later ones ``kwargs=``: neither is read
        # key, value: [1, kv_heads, T, head_dim] -> rows (slot_t, :, row_t)
        self.pool.keys[layer_idx][self.slot_index, :, self.rows] = key[0].transpose(0, 1)
        self.pool.values[layer_idx][self.slot_index, :, self.rows] = value[0].transpose(0, 1)
        return key, value


@dataclass(frozen=True)
class TreeRows:
    """Every tree segment's rows of a forward (``Segment.visible``), attended in one call of the
    block tree: flat query rows ``rows`` [R] of slots ``slots`` [R], each seeing ``visible`` [R, W]
    over a span of ``blocks`` KV_BLOCKs (the power of two holding the furthest segment's end)."""

    rows: torch.Tensor
    slots: torch.Tensor
    visible: torch.Tensor
    blocks: int

    @staticmethod
    def of(pool: KVPool, segments: Sequence[Segment], offsets: Sequence[int]) -> TreeRows | None:
        trees = [(s, q0) for s, q0 in zip(segments, offsets, strict=False) if s.visible is not None]
        if not trees:
            return None
        width = max(s.end for s, _ in trees)
        blocks = pow2_blocks(width)
        held = pool.keys[0].shape[2]
        visible = torch.zeros(sum(s.length for s, _ in trees), width, dtype=torch.bool)
        r = 0
        for s, _ in trees:
            assert s.visible is not None
            visible[r:r + s.length, :s.end] = s.visible
            r += s.length
            # key rows of the span past the segment are read masked: they must be finite
            pool.ready(s.slot, s.end, min(blocks * KV_BLOCK, held))
        dev = pool.device
        rows = torch.cat([torch.arange(q0, q0 + s.length) for s, q0 in trees])
        slots = torch.cat([torch.full((s.length,), s.slot, dtype=torch.int64) for s, _ in trees])
        return TreeRows(rows.to(dev), slots.to(dev), visible.to(dev), blocks)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
               out: torch.Tensor) -> None:
        """``query`` [heads, T, dim] (the forward's rows); writes the tree rows of ``out`` [T, heads, dim]."""
        got = tree_attention(query.index_select(1, self.rows), keys, values, self.slots, self.visible,
                             self.blocks, scaling)
        out.index_copy_(0, self.rows, got)


def _causal(seg: Segment, device: torch.device) -> torch.Tensor:
    query_pos = torch.arange(seg.start, seg.end, device=device)[:, None]
    return torch.arange(seg.end, device=device)[None, :] <= query_pos  # [length, end]


def _slot_attention(module: CausalLM, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    card_batch: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention per session over its own slot; any other forward (a plain HF call on the same
    model object, a reference in the tests) takes transformers' SDPA path unchanged."""
    if card_batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if getattr(card_batch, "static", False):  # a static step (card.engine.shared.static_step)
        return card_batch.attend(layer, query, scale), None
    pool = card_batch.pool
    keys, values = pool.keys[layer], pool.values[layer]
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])  # [1, T, heads, dim]
    gqa = query.shape[1] != keys.shape[1]
    kernel, planned = card_batch.kernel, card_batch.row_plan
    if kernel is not None:  # every exact segment, in one C call
        kernel.attend(query[0], keys, values, scale, out[0])
    if planned is not None:  # every exact decoding segment at once
        planned.attend(query[0], keys, values, scale, out[0])
    if card_batch.tree is not None:  # every tree segment at once
        card_batch.tree.attend(query[0], keys, values, scale, out[0])
    for seg, q0, mask in zip(card_batch.segments, card_batch.offsets, card_batch.masks, strict=False):
        if (seg.exact and kernel is not None) or (seg.exact and not seg.prefill and planned is not None) or (
                seg.visible is not None and (card_batch.tree is not None or kernel is not None)):
            continue
        q = query[:, :, q0:q0 + seg.length]  # [1, heads, n, dim]
        if seg.exact and seg.prefill:
            out[0, q0:q0 + seg.length] = attend_blocks(q[0], keys[seg.slot], values[seg.slot], seg.start,
                                                       scale)
            continue
        if seg.exact:
            out[0, q0:q0 + seg.length] = attend_rows(q[0], keys[seg.slot], values[seg.slot], seg.start, scale)
            continue
        k = keys[seg.slot, :, :seg.end][None]  # [1, kv_heads, end, dim], a view
        v = values[seg.slot, :, :seg.end][None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                                             enable_gqa=gqa)
        out[0, q0:q0 + seg.length] = o[0].transpose(0, 1)
    return out, None


_registered = False
# model families whose model forward is embed -> decoder layers -> norm -> LM head and nothing
# else, which is what ``forward`` runs (SmolLM2 is a Llama)
MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def enable(model: CausalLM) -> None:
    """Let ``model`` run batched forwards (idempotent). Plain forwards keep transformers' SDPA."""
    global _registered
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) or not hasattr(
            model, "lm_head"):
        raise FailedPrecondition(
            f"{type(model).__name__} is not a supported architecture (a decoder-only model "
            "with model.embed_tokens/layers/norm/rotary_emb and lm_head, e.g. Llama or Qwen2)")
    kind = getattr(model.config, "model_type", None)
    if kind not in MODEL_TYPES:
        # the engine runs the decoder layers itself, from the embedding to the LM head: a family
        # whose model forward does more (Gemma scales its embeddings, Granite multiplies them,
        # Gemma 2 caps its logits) would decode, and every token would be wrong
        raise FailedPrecondition(
            f"{type(model).__name__} (model_type {kind!r}) is not a supported architecture; supported: "
            f"{', '.join(sorted(MODEL_TYPES))}")
    layer_class = type(model.model.layers[0])
    if (keyword := cache_keyword(layer_class)) != CACHE_KEYWORD:
        raise FailedPrecondition(f"{layer_class.__name__} takes its KV cache as {keyword!r}, the "
                                 f"installed transformers' other decoder layers as {CACHE_KEYWORD!r}")
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", False):
        raise FailedPrecondition(f"{type(model).__name__} uses a sliding window, which the KV "
                                 "cache does not support")
    if not _registered:
        AttentionInterface.register(ATTN, _slot_attention)
        AttentionMaskInterface.register(ATTN, sdpa_mask)
        _registered = True
    if model.config._attn_implementation != ATTN:
        model.set_attn_implementation(ATTN)


@torch.inference_mode()
def forward(model: CausalLM, pool: KVPool, segments: Sequence[Segment], tokens: torch.Tensor,
            logit_rows: torch.Tensor) -> torch.Tensor:
    """One forward over every segment's tokens (``tokens`` [T], segments in order); the logits of
    the flattened rows ``logit_rows`` [R] only (a prefill chunk needs none or its last row)."""
    batch = _Batch(pool, segments)
    inner = model.model
    hidden = inner.embed_tokens(tokens.to(pool.device)[None])  # [1, T, hidden]
    positions = batch.positions[None]
    rotary = inner.rotary_emb(hidden, positions)
    lean = lean_layers(model, _slot_attention)
    if lean is not None:  # transformers' ops without its Python around them (lean_layers)
        for step in lean:
            hidden = step(hidden, rotary, batch, card_batch=batch)
    else:
        for layer in inner.layers[: model.config.num_hidden_layers]:
            hidden = layer(hidden, position_ids=positions, position_embeddings=rotary, card_batch=batch,
                           **{CACHE_KEYWORD: batch})
    if not logit_rows.numel():
        return hidden.new_empty(0, 0)
    hidden = inner.norm(hidden[:, logit_rows.to(pool.device)])  # per-row: select first, then norm
    return model.lm_head(hidden)[0]  # [R, vocab]
