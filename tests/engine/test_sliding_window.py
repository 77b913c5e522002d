"""A model with a sliding attention window (Mistral-7B-v0.1: 4,096 of its 32,768 positions) is served
up to its window: there a sliding window sees every earlier token, which is what the engine's
attention computes (card.engine.loading.models.context_window_of bounds every request by it). The
negative control shows why: past the window the model attends to fewer tokens than the engine, and
the logits part."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, MistralConfig, MistralForCausalLM, Qwen2Config

from card.engine.loading.models import context_window_of
from card.engine.shared.kv_pool import KVPool, Segment, forward

WINDOW = 8


def test_the_context_window_stops_at_the_attention_window() -> None:
    assert context_window_of(MistralConfig(max_position_embeddings=32768, sliding_window=4096)) == 4096
    assert context_window_of(MistralConfig(max_position_embeddings=32768, sliding_window=None)) == 32768
    assert context_window_of(Qwen2Config(max_position_embeddings=32768, sliding_window=4096,
                                         use_sliding_window=False)) == 32768
    assert context_window_of(LlamaConfig(max_position_embeddings=8192)) == 8192


@torch.inference_mode()
def test_the_engine_equals_the_model_up_to_the_window_and_not_past_it() -> None:
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           sliding_window=WINDOW, attn_implementation="sdpa")
    model = MistralForCausalLM(config).to(torch.float64).eval()
    tokens = torch.randint(0, 97, (3 * WINDOW,), generator=torch.Generator().manual_seed(1))
    theirs = model(input_ids=tokens[None]).logits[0]  # transformers' own forward, its window on
    assert context_window_of(model.config) == WINDOW
    pool = KVPool(model, slots=1, max_len=4 * WINDOW)
    ours = forward(model, pool, [Segment(0, 0, tokens.numel())], tokens, torch.arange(tokens.numel()))
    assert torch.allclose(ours[:WINDOW], theirs[:WINDOW], atol=1e-9)  # within the window: the model
    assert not torch.allclose(ours[WINDOW + 1:], theirs[WINDOW + 1:], atol=1e-3)  # past it: not
