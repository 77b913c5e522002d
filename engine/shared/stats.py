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
    # the acceptance rule that ran (config.Verify): "loose" is lossy; "rejection" (sampled
    # requests only) follows the target's distribution but not plain decoding's tokens
    verify: str = "exact"
    draft_tokens: int = 0  # drafted tokens the target verified
    accepted_draft_tokens: int = 0  # of them, kept (loose: including loose_kept)
    loose_kept: int = 0  # kept drafted tokens that were not the target's own (loose only)
    # acceptance_histogram[j]: verification steps with a drafted chain that kept exactly j of it
    acceptance_histogram: list[int] = field(default_factory=list)
    # rejection: chains without a usable proposal, verified exactly instead (lossless still)
    rejection_fallbacks: int = 0
    # the target's drafting policy (card.engine.target.drafting_policy): its regime, the steps this
    # generation decoded with its drafting paused (plain decoding engine-wide, or its own chains
    # not paying) and how many times its drafting was paused
    speculation: str = ""
    drafting_paused_steps: int = 0
    drafting_pauses: int = 0
    # prompt tokens whose keys and values came from the target's prefix cache (not prefilled)
    cached_tokens: int = 0

    def observe_step(self, drafted: int, kept: int) -> None:
        """One verification of ``drafted`` chain tokens that kept ``kept`` (no chain: no step)."""
        if drafted <= 0:
            return
        self.draft_tokens += drafted
        self.accepted_draft_tokens += kept
        if len(self.acceptance_histogram) <= kept:
            self.acceptance_histogram += [0] * (kept + 1 - len(self.acceptance_histogram))
        self.acceptance_histogram[kept] += 1

    @property
    def lossy(self) -> bool:
        """The tokens may differ from plain decoding's by the request's choice (verify loose)."""
        return self.verify == "loose"

    @property
    def token_exact(self) -> bool:
        """The tokens are plain decoding's for the same seed (not so under loose or rejection)."""
        return self.verify == "exact"

    @property
    def spec_steps(self) -> int:
        return sum(self.acceptance_histogram)

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
            lossy=self.lossy,
            token_exact=self.token_exact,
        )
        return d

    def summary(self) -> str:
        line = (
            f"{self.new_tokens} tokens in {self.wall_s:.2f}s ({self.tokens_per_s:.2f} tok/s), "
            f"mode={self.mode}, mean accepted length {self.mean_accepted_length:.2f}"
        )
        if self.cached_tokens:
            line += f", {self.cached_tokens} of {self.prompt_tokens} prompt tokens from the prefix cache"
        if self.corrections:
            line += f", hit rate {self.hit_rate:.0%} (secondary {self.secondary_hit_rate:.0%})"
        if self.drafting_paused_steps:
            line += (f", drafting paused for {self.drafting_paused_steps} of {self.target_forwards} steps "
                     f"(speculation {self.speculation or 'auto'})")
        if not self.exact:
            line += ", inexact (--exact off: vendor kernels, tokens may change with the load)"
        if self.lossy:
            line += (f", LOSSY (verify loose: {self.loose_kept} drafted tokens kept that plain "
                     "decoding would not have chosen)")
        elif self.verify == "rejection":
            line += ", verify rejection (the target's distribution, not plain decoding's tokens for the seed)"
        return line
