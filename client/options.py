"""The options of ``card-client generate``, built once from flags and CARD_* variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from card.engine.loading.models import DEFAULT_MODEL, ModelConfig
from card.engine.shared.config import (
    ChainPolicy,
    DrafterKind,
    Mode,
    NgramConfig,
    SamplingParams,
    StopParams,
    TreeParams,
    Verify,
    VerifyPolicy,
)

if TYPE_CHECKING:  # the runner imports the whole engine (transformers: seconds); only in-process runs need it
    from card.engine.inprocess.runner import RunnerConfig

# The embedded default pair: SmolLM2-135M-Instruct drafting for itself, dynamically quantized to
# int8 (training-free; docs/default-draft.md has the measurement behind the choice).
DEFAULT_DRAFT = ModelConfig(spec=DEFAULT_MODEL, quantize="int8")


def default_thread_split(cores: int | None = None) -> tuple[int, int]:
    """(target, draft) torch threads for in-process card: the draft gets a quarter, at least one."""
    cores = cores or os.cpu_count() or 1
    draft = max(1, cores // 4)
    return max(1, cores - draft), draft


@dataclass(frozen=True)
class GenerateOptions:
    """``tree``: the hardware default with every tree flag over it (in-process runs and a local
    trio's services); ``chain``: the chain flags that were given, which travel with a request to a
    running target; ``draft_shape``: the draft-shape flags that were given (``--tree-width`` ...),
    which only the process that grows the tree can honour; ``drafter``: neural, cascade (n-gram
    statistics beneath the draft model) or ngram (``--draft-model ngram``, no draft model), with
    the n-gram settings ``ngram`` (engine.shared.config.DrafterKind, parsed once from the flags)."""

    prompt: str
    mode: Mode
    target: ModelConfig
    draft: ModelConfig
    sampling: SamplingParams
    stop: StopParams
    tree: TreeParams
    chain: ChainPolicy = field(default_factory=ChainPolicy)
    draft_shape: tuple[str, ...] = ()
    gamma: int = 4
    chat: bool | None = None
    target_threads: int | None = None
    draft_threads: int | None = None
    backoff: bool = True
    draft_name: str | None = None
    drafter: DrafterKind = DrafterKind.NEURAL
    ngram: NgramConfig = field(default_factory=NgramConfig)
    verify: Verify = Verify.EXACT
    loose_entropy_threshold: float | None = None  # None: the target's (in process: FLy's default)
    loose_window: int | None = None
    logprobs: int | None = None

    def verify_policy(self) -> VerifyPolicy:
        """The acceptance rule of an in-process run (a target service fills its own defaults)."""
        base = VerifyPolicy()
        return VerifyPolicy(self.verify,
                            base.entropy_threshold if self.loose_entropy_threshold is None
                            else self.loose_entropy_threshold,
                            base.window if self.loose_window is None else self.loose_window)

    def runner_config(self) -> RunnerConfig:
        from card.engine.inprocess.runner import RunnerConfig

        if self.mode is Mode.VANILLA:
            return RunnerConfig(mode=Mode.VANILLA, target_threads=self.target_threads or os.cpu_count() or 1)
        d: int | None  # None: the in-process drafter runs on the target's thread
        t, d = default_thread_split()
        if self.drafter is DrafterKind.NGRAM:  # the drafter is one Python thread: every core to the target
            t, d = os.cpu_count() or 1, None
        return RunnerConfig(
            mode=self.mode,
            tree=self.tree,
            gamma=self.gamma,
            target_threads=self.target_threads or (os.cpu_count() if self.mode is Mode.SD else t),
            draft_threads=self.draft_threads or d,
            backoff=self.backoff,
            drafter=self.drafter,
            ngram=self.ngram,
        )
