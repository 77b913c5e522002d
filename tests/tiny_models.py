"""The models the tests run: the embedded default (SmolLM2-135M-Instruct) and tiny random causal
LMs built in code with fixed seeds, for exhaustive exactness tests.

``default_gguf`` is the default model's GGUF, fetched and cached the way ``card generate`` fetches
it (card.engine.loading.embedded); ``smollm2_tokenizer_dir`` its tokenizer as files, built from the
GGUF by the loader's own ``load_tokenizer``. ``tiny_model`` gives an in-memory model;
``save_tiny_checkpoint`` writes a folder that ``card.engine.loading.models.load_model`` (and so every
service entry point) loads like any checkpoint, with that tokenizer beside it so prompts, chat
templates and fingerprints are real. Nothing here reads outside the repository and the model cache.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from card.engine.loading.embedded import ensure_default_model, models_dir
from card.engine.shared.errors import Unavailable

SMOLLM2_VOCAB = 49152


@functools.cache
def default_gguf() -> Path:
    """The embedded default model's GGUF: fetched into the model cache ($CARD_MODELS_DIR or
    ~/.cache/card/models) on first use, sha256-checked, then read from there.

    A model that cannot be fetched fails the test that needs it, with pip's reason and how to get
    the file by hand; it is never a skip (a suite that skips its end-to-end tests on a fresh clone
    passes by accident). Under CI=true the message says how to give the job the model."""
    try:
        return ensure_default_model(progress=False)
    except Unavailable as exc:
        reason = str(exc)
    where = (f"CI=true: give the job network access to the package index, or restore a cached "
             f"{models_dir()} ($CARD_MODELS_DIR). " if os.environ.get("CI") == "true" else "")
    pytest.fail(f"the tests need the default model and it cannot be fetched. {where}{reason}", pytrace=False)


@functools.cache
def smollm2_tokenizer_dir() -> Path:
    """The default model's tokenizer as files (tokenizer.json, tokenizer_config.json,
    chat_template.jinja), written once per test process by the loader from the GGUF."""
    from card.engine.loading.models import load_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="card-tests-tokenizer-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    load_tokenizer(str(default_gguf())).save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


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
    elif kind == "qwen3":  # per-head RMSNorms of q and k before the rotary embedding
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden // 4))
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    model = model.to(dtype).eval()
    if perturb:
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * perturb)
    return model


def with_idle_layers(model: torch.nn.Module, idle: int) -> torch.nn.Module:
    """``model`` followed by ``idle`` more decoder layers whose attention and MLP outputs are
    exactly zero (o_proj and down_proj zeroed): the same logits bit for bit, at a higher cost.

    A draft is the plain model, its target this one: the draft gets ahead by construction, where a
    draft as costly as its target only sometimes wins the race (and on a loaded CI core, never)."""
    if idle <= 0:
        return model
    spec = model.config.to_dict()
    spec["num_hidden_layers"] += idle
    spec.pop("layer_types", None)  # per-layer lists (Qwen2) are rebuilt for the new depth
    config = model.config.__class__.from_dict(spec)
    dearer = model.__class__(config).to(model.dtype).eval()
    missing, unexpected = dearer.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".layers." in key for key in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in dearer.model.layers[-idle:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return dearer


def save_tiny_checkpoint(path: Path, kind: str = "llama", seed: int = 0, perturb: float = 0.0,
                         dtype: torch.dtype = torch.float32, layers: int = 2, hidden: int = 32,
                         idle_layers: int = 0) -> Path:
    """A loadable checkpoint folder: tiny weights + the SmolLM2 tokenizer (vocab 49152);
    ``idle_layers``: see ``with_idle_layers`` (same outputs as without, dearer forwards)."""
    tokenizer = smollm2_tokenizer_dir()
    model = tiny_model(kind, seed, vocab=SMOLLM2_VOCAB, layers=layers, hidden=hidden,
                       perturb=perturb, dtype=dtype)
    model = with_idle_layers(model, idle_layers)
    model.config.eos_token_id = 2
    model.config.bos_token_id = 1
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    shutil.copytree(tokenizer, path, dirs_exist_ok=True)
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
