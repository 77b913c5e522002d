"""Per-generation statistics, named as in DESIGN.md §8."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    mode: str = "vanilla"
    prompt_tokens: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    target_forwards: int = 0
    draft_forwards: int = 0
    hits: int = 0
    secondary_hits: int = 0
    misses: int = 0
    target_idle_s: float = 0.0
    draft_idle_s: float = 0.0
    step_rtt_ms: list[float] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    exact: bool = True  # the target's batch-invariant forward ran (False: --exact off)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward (1.0 for plain decoding)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def corrections(self) -> int:
        return self.hits + self.secondary_hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.corrections if self.corrections else 0.0

    @property
    def secondary_hit_rate(self) -> float:
        return self.secondary_hits / self.corrections if self.corrections else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tokens_per_s=self.tokens_per_s,
            mean_accepted_length=self.mean_accepted_length,
            hit_rate=self.hit_rate,
            secondary_hit_rate=self.secondary_hit_rate,
        )
        return d

    def summary(self) -> str:
        line = (
            f"{self.new_tokens} tokens in {self.wall_s:.2f}s ({self.tokens_per_s:.2f} tok/s), "
            f"mode={self.mode}, mean accepted length {self.mean_accepted_length:.2f}"
        )
        if self.corrections:
            line += f", hit rate {self.hit_rate:.0%} (secondary {self.secondary_hit_rate:.0%})"
        if not self.exact:
            line += ", inexact (--exact off: vendor kernels, tokens may change with the load)"
        return line
