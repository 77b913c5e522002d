"""The target's side of one generation: the committed sequence and the acceptance rule.

Committed sequence = prompt + every token the target emitted; it has one owner per process, this
object. The KV cache (card.engine.shared.kv_pool, filled by the engine's batched forwards) covers every
committed token but the last one (the *next token*), which rides at the head of the next
verification: a step forwards ``[next_token, *chain]`` at positions ``len(committed) - 1 ...``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from card.engine.shared.config import SamplingParams
from card.engine.target.sampling import select_token


class TargetState:
    def __init__(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.sampling = sampling
        self.committed: list[int] = list(prompt_ids)
        self.forwards = 0

    def first(self, logits: torch.Tensor) -> int:
        """Commit the first new token from the prompt's last logits [V]; returns it."""
        token = select_token(logits, len(self.committed), self.sampling)
        self.committed.append(token)
        return token

    def accept(self, chain: Sequence[int], logits: torch.Tensor) -> tuple[int, int]:
        """Judge ``chain`` given the logits [1 + len(chain), V] of ``[next_token, *chain]``;
        returns (accepted count, new next token).

        Accepts the longest prefix where the target's own token equals the chain token; the
        target's token after it is committed too, so every call commits ``accepted + 1`` tokens.
        """
        start = len(self.committed) - 1  # position of the next token
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
        return accepted, token
