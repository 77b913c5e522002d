"""Tokenizer fingerprint: whether a draft may serve a target.

Two tokenizers with the same fingerprint turn every text into the same ids and back: same
vocabulary and merges, same normalizer / pre-tokenizer / decoder, same special and added tokens.
Settings that do not change ids (padding, truncation, the chat template) are left out, so a base
and an instruct model of one family match.
"""

from __future__ import annotations

import hashlib
import json

from card.engine.shared.hf import Tokenizer


def _canonical(tokenizer: Tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        return {
            "model": spec.get("model"),
            "normalizer": spec.get("normalizer"),
            "pre_tokenizer": spec.get("pre_tokenizer"),
            "decoder": spec.get("decoder"),
            "added_tokens": sorted(
                (t["id"], t["content"], bool(t.get("special"))) for t in spec.get("added_tokens", [])
            ),
        }
    vocab = tokenizer.get_vocab()  # slow tokenizers: the vocabulary is all we can compare
    return {"vocab": sorted(vocab.items()), "special": sorted(map(str, tokenizer.all_special_tokens))}


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A short stable hex digest of everything that decides token ids."""
    blob = json.dumps(_canonical(tokenizer), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
