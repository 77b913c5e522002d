"""Sizing of the KV caches (engine.shared.kv_pool.pool_shape): the one rule of card-target and card-draft."""

from __future__ import annotations

import pytest

from card.draft_service.config import DraftConfig
from card.engine.loading.models import ModelConfig
from card.engine.shared.config import TreeParams
from card.engine.shared.errors import InvalidArgument, ResourceExhausted
from card.engine.shared.exact_attention import KV_BLOCK
from card.engine.shared.kv_pool import (
    CACHED_PER_SLOT,
    DEVICE_KV_SHARE,
    SHORTEST_DEFAULT_LEN,
    check_sizing,
    pool_shape,
    size_pool,
)
from card.target_service.config import TargetConfig

KB = 1024


def test_slots_and_rows_from_flags_window_and_budget() -> None:
    assert pool_shape(8, None, 512, 46 * KB, None) == (8, 512)  # the model's context window
    assert pool_shape(8, None, 32768, 46 * KB, None) == (8, 32768)  # no budget (the CPU): the whole window
    assert pool_shape(8, 1000, 32768, 46 * KB, None) == (8, 1000)
    # 1 GiB of 1000-token slots at 46 KB per token: 22 fit, one is the scratch slot, 8 are asked for
    assert pool_shape(8, 1000, 32768, 46 * KB, 1.0) == (8, 1000)
    # 0.15 GiB: 3 slots of 1000 tokens fit, one of them the scratch slot
    assert pool_shape(8, 1000, 32768, 46 * KB, 0.15) == (2, 1000)
    # a draft's tree rows count against the budget too: 3 slots of 1100 + 24 rows still fit, 1200 + 24 not
    assert pool_shape(8, 1000, 32768, 46 * KB, 0.15, extra_rows=24) == (2, 1000)
    assert pool_shape(8, 1100, 32768, 46 * KB, 0.15, extra_rows=24) == (2, 1100)
    assert pool_shape(8, 1200, 32768, 46 * KB, 0.15, extra_rows=24) == (1, 1200)
    # one sequence alone is not enough: the scratch slot needs its room too
    with pytest.raises(ResourceExhausted, match="beside the scratch"):
        pool_shape(8, 1000, 32768, 46 * KB, 0.06)
    with pytest.raises(ResourceExhausted, match="holds no sequence"):
        pool_shape(8, 4096, 32768, 46 * KB, 0.01)


@pytest.mark.parametrize(("gb", "max_len"), [(0.0, None), (-1.0, None), (None, 1)])
def test_bad_sizing_flags_are_refused(gb: float | None, max_len: int | None) -> None:
    with pytest.raises(InvalidArgument):
        check_sizing(gb, max_len)
    with pytest.raises(InvalidArgument):
        TargetConfig(model=ModelConfig("default"), kv_cache_gb=gb, max_model_len=max_len)
    with pytest.raises(InvalidArgument):
        DraftConfig(cache_addr="127.0.0.1:1", model=ModelConfig("default"), name="d", kv_cache_gb=gb,
                    max_model_len=max_len)


def test_target_and_draft_size_alike_but_the_draft_keeps_room_for_its_tree() -> None:
    target = TargetConfig(model=ModelConfig("default"), max_batch_size=8, kv_cache_gb=0.15,
                          max_model_len=1000)
    draft = DraftConfig(cache_addr="127.0.0.1:1", model=ModelConfig("default"), name="d", capacity=8,
                        kv_cache_gb=0.15, max_model_len=1200, tree=TreeParams(width=3, max_depth=8))
    assert target.kv_shape(8192, 46 * KB) == (2, 1000)
    assert draft.kv_shape(8192, 46 * KB) == (1, 1200)  # 1200 + 24 tree rows: one slot and the scratch


GB = 2**30


def test_the_default_length_is_the_context_window_where_the_budget_holds_every_slot_of_it() -> None:
    """vLLM's rule on static slots: --max-model-len defaults to the model's context window; a budget
    (--kv-cache-gb, or a share of an accelerator's free memory) that cannot hold --max-batch-size
    sequences of it shortens the length to what it holds (whole KV blocks), down to
    SHORTEST_DEFAULT_LEN, then gives fewer slots; each choice says why in one line."""
    per_token = 56 * KB  # Qwen2.5-7B's keys and values in bf16
    # an accelerator with room: the whole 32k window for 8 slots and the scratch slot (15.75 GB)
    roomy = size_pool(8, None, 32768, per_token, None, free_bytes=40 * GB)
    assert (roomy.slots, roomy.max_len) == (8, 32768)
    assert roomy.why.startswith("the model's context window")
    assert f"{DEVICE_KV_SHARE:.0%} of the 40.0 GB" in roomy.why
    # 10 GB free: 8 GB of budget holds 4 sequences of 32k beside the scratch slot; the length shrinks
    # instead, to the longest that keeps 8 (9 x 56 KB x 16640 <= 8 GB), in whole KV blocks
    tight = size_pool(8, None, 32768, per_token, None, free_bytes=10 * GB)
    assert tight.slots == 8 and tight.max_len % KV_BLOCK == 0
    assert 9 * per_token * tight.max_len <= 8 * GB < 9 * per_token * (tight.max_len + KV_BLOCK)
    assert "would hold 3" in tight.why and "--max-model-len sets the length" in tight.why
    # too tight for 8 slots of even SHORTEST_DEFAULT_LEN: that length, fewer slots
    small = size_pool(8, None, 32768, per_token, 1.0)
    assert small.max_len == SHORTEST_DEFAULT_LEN and small.slots == 1 * GB // (per_token * 4096) - 1 == 3
    assert "3 of --max-batch-size 8 sequences fit" in small.why and "--kv-cache-gb 1" in small.why
    # negative control: an explicit --max-model-len is kept whatever it costs in slots
    explicit = size_pool(8, 32768, 32768, per_token, None, free_bytes=10 * GB)
    assert (explicit.slots, explicit.max_len) == (3, 32768)
    assert explicit.why.startswith("--max-model-len 32768")
    # and never longer than the model's window
    assert size_pool(8, 50000, 32768, per_token, None).max_len == 32768
    # the draft names its own flag, and its tree's rows count against the budget
    draft = size_pool(8, None, 32768, per_token, None, extra_rows=24, free_bytes=10 * GB,
                      slots_flag="--capacity")
    assert draft.slots == 8 and draft.max_len < tight.max_len + KV_BLOCK and "--capacity 8" in draft.why
    # a budget that holds not one sequence of the shortest default fails, saying what to change
    with pytest.raises(ResourceExhausted, match=r"the KV budget .* holds no sequence of 4096 tokens"):
        size_pool(8, None, 32768, per_token, None, free_bytes=GB // 4)


def test_the_start_up_line_says_what_was_chosen_and_why() -> None:
    shape = size_pool(8, None, 8192, 46 * KB, None)
    line = shape.describe(9 * 8192 * 46 * KB)
    assert line == ("KV cache: 8 slots x 8192 tokens (3.23 GB): the model's context window (no KV budget: "
                    "on the CPU a row takes memory once written)")
    assert "\n" not in size_pool(8, None, 32768, 56 * KB, None, free_bytes=10 * GB).describe(0)


def test_the_kv_memory_fraction_sets_the_share_of_free_device_memory() -> None:
    """--kv-cache-memory-fraction (vLLM's --gpu-memory-utilization, over the memory free once the
    model is loaded): half of 10 GB holds fewer tokens than the default share; out of (0, 1] refused."""
    per_token = 56 * KB
    default = size_pool(8, None, 32768, per_token, None, free_bytes=10 * GB)
    half = size_pool(8, None, 32768, per_token, None, free_bytes=10 * GB, memory_fraction=0.5)
    assert half.slots == 8 and half.max_len < default.max_len
    assert 9 * per_token * half.max_len <= 5 * GB < 9 * per_token * (half.max_len + KV_BLOCK)
    assert "50% of the 10.0 GB free" in half.why and "--kv-cache-memory-fraction" in half.why
    assert TargetConfig(model=ModelConfig("default"), kv_cache_memory_fraction=0.5).kv_sizing(
        32768, per_token, 10 * GB) == half
    for bad in (0.0, 1.5):
        with pytest.raises(InvalidArgument, match="kv-cache-memory-fraction"):
            TargetConfig(model=ModelConfig("default"), kv_cache_memory_fraction=bad)
        with pytest.raises(InvalidArgument, match="kv-cache-memory-fraction"):
            DraftConfig(cache_addr="127.0.0.1:1", model=ModelConfig("default"), name="d",
                        kv_cache_memory_fraction=bad)


def test_finished_sequences_get_slots_of_their_own_within_the_budget() -> None:
    """Prefix caching past the live slots (kv_pool.CACHED_PER_SLOT): on the CPU (no budget) a
    byte bound on what they keep resident; with a budget, only as many as it holds past the live
    ones, which it pays for; none without prefix caching or at 0 GB."""
    cpu = size_pool(8, None, 8192, 46 * KB, None, prefix_cache_gb=2.0)
    assert (cpu.slots, cpu.cached_slots, cpu.cache_bytes) == (8, 8 * CACHED_PER_SLOT, 2 * 2**30)
    assert cpu.describe(0).endswith("; prefix caching keeps finished sequences in 32 more slots (at most "
                                    "2.00 GB of them resident)")
    assert size_pool(8, None, 8192, 46 * KB, None).cached_slots == 0  # prefix caching off
    assert size_pool(8, None, 8192, 46 * KB, None, prefix_cache_gb=0.0).cached_slots == 0
    # 1 GiB of 1000-token slots at 46 KB per token: 22 fit, one the scratch slot, 8 live: 13 more
    budget = size_pool(8, 1000, 32768, 46 * KB, 1.0, prefix_cache_gb=4.0)
    assert (budget.slots, budget.cached_slots, budget.cache_bytes) == (8, 13, None)
    assert "within the KV budget" in budget.describe(0)
    # a budget with room for more than CACHED_PER_SLOT per slot takes no more than that
    roomy = size_pool(2, 1000, 32768, 46 * KB, 1.0, prefix_cache_gb=4.0)
    assert roomy.cached_slots == 2 * CACHED_PER_SLOT
    # a budget that holds the live slots alone: none
    exact_fit = 9 * 1000 * 46 * KB / 2**30
    assert size_pool(8, 1000, 32768, 46 * KB, exact_fit, prefix_cache_gb=4.0).cached_slots == 0


def test_the_services_size_the_cached_slots_from_their_flags() -> None:
    target = TargetConfig(model=ModelConfig("default"), prefix_cache_gb=1.5)
    assert target.kv_sizing(8192, 46 * KB).cache_bytes == int(1.5 * 2**30)
    off = TargetConfig(model=ModelConfig("default"), enable_prefix_caching=False)
    assert off.kv_sizing(8192, 46 * KB).cached_slots == 0
    with pytest.raises(InvalidArgument, match="prefix-cache-gb"):
        TargetConfig(model=ModelConfig("default"), prefix_cache_gb=-1.0)


def test_the_draft_sizes_its_cached_slots_from_its_flag() -> None:
    draft = DraftConfig(cache_addr="127.0.0.1:1", model=ModelConfig("default"), name="d", capacity=4)
    shape = draft.kv_sizing(8192, 46 * KB)
    assert (shape.cached_slots, shape.cache_bytes) == (4 * CACHED_PER_SLOT, 2 * 2**30)
    with pytest.raises(InvalidArgument, match="prefix-cache-gb"):
        DraftConfig(cache_addr="127.0.0.1:1", model=ModelConfig("default"), name="d", prefix_cache_gb=-2.0)
