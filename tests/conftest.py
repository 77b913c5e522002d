"""Fixtures every test folder shares: the embedded default model, fetched once per machine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Triton kernels (card.engine.shared.triton_attention) run in Triton's interpreter where there is no
# NVIDIA GPU. Set before anything imports triton: its own library functions are decorated at import
# (torch may import it early), and the interpreter only runs functions decorated under it.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.tiny_models import default_gguf, smollm2_tokenizer_dir


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF), the model ``card generate`` runs by default: fetched and
    cached the way it fetches it; a model that cannot be had fails the test (tests.tiny_models)."""
    return default_gguf()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Path:
    """A folder holding the default model's tokenizer files, built from its GGUF by the loader."""
    return smollm2_tokenizer_dir()
