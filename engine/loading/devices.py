"""The one device resolver: what ``--device`` means for every entry point."""

from __future__ import annotations

import torch

from card.engine.shared.errors import InvalidArgument


def resolve_device(device: str) -> torch.device:
    """``auto`` = cuda when present, else cpu; anything else must be a device torch knows and this
    machine has (InvalidArgument otherwise, naming the value)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise InvalidArgument(f"unknown device {device!r}: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device {device} was asked for but CUDA is not available")
    return resolved
