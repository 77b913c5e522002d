"""Tiny random causal LMs built in code with fixed seeds, for exhaustive exactness tests.

``tiny_model`` gives an in-memory model; ``save_tiny_checkpoint`` writes a folder that
``card.engine.loading.models.load_model`` (and so every service entry point) loads like any checkpoint, with
the real SmolLM2 tokenizer beside it so prompts, chat templates and fingerprints are real.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SMOLLM2_DIR = SHARED / "models" / "smollm2-135m-instruct-q4_1"
SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_model(kind: str = "llama", seed: int = 0, vocab: int = 97, layers: int = 2,
               hidden: int = 32, perturb: float = 0.0, perturb_seed: int = 1,
               dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A random model; ``perturb`` > 0 adds seeded noise of that scale to every weight."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    model = model.to(dtype).eval()
    if perturb:
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * perturb)
    return model


def save_tiny_checkpoint(path: Path, kind: str = "llama", seed: int = 0, perturb: float = 0.0,
                         dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32) -> Path:
    """A loadable checkpoint folder: tiny weights + the SmolLM2 tokenizer (vocab 49152).

    Skips the calling test where the tokenizer (in ../shared beside the checkout) is absent."""
    missing = [name for name in TOKENIZER_FILES if not (SMOLLM2_DIR / name).is_file()]
    if missing:
        import pytest

        pytest.skip(f"the SmolLM2 tokenizer ({', '.join(missing)}) is not in {SMOLLM2_DIR}")
    model = tiny_model(kind, seed, vocab=SMOLLM2_VOCAB, layers=layers, hidden=hidden,
                       perturb=perturb, dtype=dtype)
    model.config.eos_token_id = 2
    model.config.bos_token_id = 1
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(SMOLLM2_DIR / name, path / name)
    return path


def save_foreign_tokenizer_checkpoint(path: Path, seed: int = 0) -> Path:
    """A tiny checkpoint whose tokenizer gives different ids (one extra added token), so its
    fingerprint differs from SmolLM2's: a draft that must be refused."""
    import json

    save_tiny_checkpoint(path, seed=seed)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["added_tokens"].append({
        "id": SMOLLM2_VOCAB - 1, "content": "<|foreign|>", "single_word": False, "lstrip": False,
        "rstrip": False, "normalized": False, "special": True,
    })
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def sharpened(model: torch.nn.Module, factor: float = 40.0) -> torch.nn.Module:
    """Scale the LM head in place so next-token distributions are peaked, not near uniform.

    Random tiny models give almost flat softmaxes, where a greedy draft's token is the target's
    sampled token about 1/vocab of the time; sharpened models make sampled runs accept drafts.
    """
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model
