"""Layer-truncated drafts: exactly the first N layers of the target, usable by every mode."""

from __future__ import annotations

import pytest
import torch

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.draft_variants import truncate_layers
from card.engine.loading.models import LoadedModel, ModelConfig, load_model
from card.engine.shared import kv_pool
from card.engine.shared.config import GenerationRequest, Mode, StopParams, TreeParams
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.kv_pool import KVPool, Segment
from tests.tiny_models import save_tiny_checkpoint, tiny_model


@pytest.mark.parametrize("n", [1, 2, 3])
def test_truncated_logits_are_the_head_read_out_after_layer_n(n):
    full = tiny_model(layers=4, seed=3)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = full(input_ids=ids, output_hidden_states=True).hidden_states[n]  # output of layer n
        expected = full.lm_head(full.model.norm(hidden))
        draft = truncate_layers(full, n)
        got = draft(input_ids=ids).logits
    assert len(draft.model.layers) == n and draft.config.num_hidden_layers == n
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_truncated_model_runs_incrementally_with_a_kv_cache():
    draft = truncate_layers(tiny_model(layers=4, seed=5), 2)
    ids = torch.arange(10) * 7 % 97
    whole = kv_pool.forward(draft, KVPool(draft, 1, 10), [Segment(0, 0, 10)], ids, torch.arange(10))
    pool = KVPool(draft, 1, 10)
    kv_pool.forward(draft, pool, [Segment(0, 0, 6)], ids[:6], torch.arange(0))
    tail = kv_pool.forward(draft, pool, [Segment(0, 6, 4)], ids[6:], torch.arange(4))
    assert len(pool.keys) == 2  # one KV layer per kept layer
    torch.testing.assert_close(tail, whole[6:], rtol=0, atol=1e-10)


def test_layer_count_is_checked():
    with pytest.raises(InvalidArgument, match=r"\[1, 4\]"):
        truncate_layers(tiny_model(layers=4), 5)
    with pytest.raises(InvalidArgument, match=r"\[1, 4\]"):
        truncate_layers(tiny_model(layers=4), 0)
    model = tiny_model(layers=4)
    assert truncate_layers(model, 4) is model and len(model.model.layers) == 4


def test_model_config_layers_loads_a_truncated_draft(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "tiny", layers=4)
    draft = load_model(ModelConfig(spec=str(path), layers=2))
    target = load_model(ModelConfig(spec=str(path), exact=True))
    assert len(draft.model.model.layers) == 2 and len(target.model.model.layers) == 4
    assert draft.fingerprint == target.fingerprint
    assert "2 layers" in draft.name
    with pytest.raises(InvalidArgument, match="layers"):
        ModelConfig(spec=str(path), layers=-1)
    with pytest.raises(InvalidArgument, match=r"\[1, 4\]"):
        load_model(ModelConfig(spec=str(path), layers=9))


class IdsAsText:
    """The text of a tokenizer-less tiny model: its ids, space-separated."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {i}" for i in ids)


@pytest.mark.parametrize("mode", ["sd", "card"])
def test_greedy_output_with_a_truncated_draft_equals_vanilla(mode):
    target = tiny_model(layers=4, seed=11, vocab=97)
    draft = truncate_layers(tiny_model(layers=4, seed=11, vocab=97), 2)

    def loaded(model: torch.nn.Module, name: str) -> LoadedModel:
        return LoadedModel(name=name, model=model, tokenizer=IdsAsText(), fingerprint="tiny",
                           eos_ids=frozenset(), context_window=512)

    request = GenerationRequest((5, 17, 3, 42), stop=StopParams(max_new_tokens=40, ignore_eos=True))
    outputs = {}
    for name, cfg in {"vanilla": RunnerConfig(mode=Mode.VANILLA),
                      mode: RunnerConfig(mode=Mode(mode), tree=TreeParams(width=3, max_depth=5))}.items():
        runner = InProcessRunner(loaded(target, "target"), loaded(draft, "L2"), cfg)
        try:
            gen = runner.generation(request)
            outputs[name] = [t for chunk in runner.stream(gen) for t in chunk.token_ids]
            assert outputs[name] == list(gen.result.token_ids)
        finally:
            runner.close()
    assert len(outputs["vanilla"]) == 40
    assert outputs[mode] == outputs["vanilla"]
