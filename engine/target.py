"""The target's side of one generation: prefill, chain verification in one forward, KV crop.

Committed sequence = prompt + every token the target emitted. The KV cache covers every committed
token but the last one (the *next token*), which rides at the head of the next verification:
``verify(chain)`` forwards ``[next_token, *chain]`` at positions ``len(committed) - 1 ...``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import kv as kvops
from engine.config import SamplingParams
from engine.sampling import select_token


class TargetState:
    def __init__(self, model: torch.nn.Module, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.model = model
        self.sampling = sampling
        self.cache = kvops.new_cache()
        self.committed: list[int] = list(prompt_ids)
        self.forwards = 0

    @property
    def next_token(self) -> int:
        return self.committed[-1]

    def prefill(self) -> int:
        """Forward the prompt and commit the first new token; returns it."""
        tokens = torch.tensor(self.committed, dtype=torch.int64)
        logits = kvops.forward(self.model, self.cache, tokens, torch.arange(tokens.numel()))
        self.forwards += 1
        token = select_token(logits[-1], len(self.committed), self.sampling)
        self.committed.append(token)
        return token

    def verify(self, chain: Sequence[int]) -> tuple[int, int]:
        """Verify ``chain`` below the next token; returns (accepted count, new next token).

        Accepts the longest prefix where the target's own token equals the chain token; the
        target's token after it is committed too, so every call commits ``accepted + 1`` tokens.
        """
        start = len(self.committed) - 1  # position of the next token
        tokens = torch.tensor([self.committed[-1], *chain], dtype=torch.int64)
        logits = kvops.forward(self.model, self.cache, tokens, torch.arange(start, start + tokens.numel()))
        self.forwards += 1
        if self.sampling.greedy:
            picks = torch.argmax(logits, dim=-1).tolist()
            accepted = 0
            while accepted < len(chain) and picks[accepted] == chain[accepted]:
                accepted += 1
            token = picks[accepted]
        else:
            accepted = 0
            while True:
                token = select_token(logits[accepted], start + 1 + accepted, self.sampling)
                if accepted < len(chain) and token == chain[accepted]:
                    accepted += 1
                    continue
                break
        self.committed.extend(chain[:accepted])
        self.committed.append(token)
        kvops.kv_crop(self.cache, len(self.committed) - 1)
        return accepted, token
