"""Sizing of the KV caches (engine.shared.kv_pool.pool_shape): the one rule of card-target and card-draft."""

from __future__ import annotations

import pytest

from card.draft_service.config import DraftConfig
from card.engine.loading.models import ModelConfig
from card.engine.shared.config import TreeParams
from card.engine.shared.errors import InvalidArgument, ResourceExhausted
from card.engine.shared.kv_pool import DEFAULT_MAX_MODEL_LEN, check_sizing, pool_shape
from card.target_service.config import TargetConfig

KB = 1024


def test_slots_and_rows_from_flags_window_and_budget() -> None:
    assert pool_shape(8, None, 512, 46 * KB, None) == (8, 512)  # the window is below the default
    assert pool_shape(8, None, 32768, 46 * KB, None) == (8, DEFAULT_MAX_MODEL_LEN)
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
