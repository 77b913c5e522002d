"""The decoding modes a benchmark compares, each behind one interface: ``run(prompt_ids, budget)``.

    vanilla, sd, card   the engine in this process (card.engine.inprocess.runner.InProcessRunner)
    card-ngram          card with the model-free n-gram drafter (card.engine.draft.ngram), no draft model
    card-cascade        card with the draft model and the n-gram statistics beneath it
    card-auto           card choosing per session between card-ngram and card (the drafting policy)
    hf                  transformers' plain greedy ``model.generate`` (cross-check of vanilla)
    hf-assisted         transformers' assisted generation with the same draft, greedy
    hf-pld              transformers' prompt lookup decoding (``prompt_lookup_num_tokens``), greedy
    svc-vanilla, svc-card   the same through the real services (a LocalTrio: redis, card-cache,
                        card-draft, card-target as subprocesses) with ``--services``
    svc-ngram, svc-cascade  through the same trio, a model-free / a cascade worker's pool
    svc-auto            through the same trio, mode card-auto: per request the cache's model-free
                        lookup alone or the draft model's worker, whichever commits faster

Every mode returns a ``GenerationStats`` (engine/stats.py) and the generated token ids, so one
report covers all of them. Each mode sets the torch thread count it runs best with before it runs:
modes that use one model at a time get every core; card splits the cores between the target (this
thread) and the draft worker thread.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from card.client.bench.costs import verify_costs
from card.common.convert import verify_to_msg
from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import (
    DrafterKind,
    GenerationRequest,
    NgramConfig,
    SamplingParams,
    StopParams,
    TreeParams,
    VerifyPolicy,
)
from card.engine.shared.config import Mode as Decoding
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.stats import GenerationStats

ENGINE_MODES = ("vanilla", "sd", "card", "card-ngram", "card-cascade", "card-auto")
HF_MODES = ("hf", "hf-assisted", "hf-pld")
MODES = ENGINE_MODES + HF_MODES
SERVICE_MODES = ("svc-vanilla", "svc-card", "svc-ngram", "svc-cascade", "svc-auto")
DEFAULT_SERVICE_MODES = ("svc-vanilla", "svc-card")  # what --services adds beside in-process modes
# The draft pool each speculating service mode names, in a trio card-bench starts: one trio serves
# them all, the model-free and cascade workers beside the draft model's (card.client.bench.cli)
# (svc-auto: mode card-auto, per request the cache's model-free lookup alone or the draft model's worker)
SERVICE_POOLS = {"svc-card": "bench-draft", "svc-ngram": "bench-ngram", "svc-cascade": "bench-cascade",
                 "svc-auto": "bench-draft"}


def service_request(mode: str, pools: Mapping[str, str]) -> tuple[str, str | None]:
    """(the GenerateRequest's mode, its draft) of service mode ``mode`` (``svc-card+loose`` too);
    ``pools``: SERVICE_POOLS in a trio card-bench started, empty for a running target (its own
    routing)."""
    base = mode.split("+")[0]
    kind = {"svc-vanilla": "vanilla", "svc-auto": "card-auto"}.get(base, "card")
    return kind, pools.get(base)
NEEDS_DRAFT = ("sd", "card", "card-cascade", "card-auto", "hf-assisted")
# hf-pld: candidate tokens per lookup (transformers' documented example uses 10; its matching
# n-gram size keeps its default, 2)
PLD_TOKENS = 10


@dataclass(frozen=True)
class ModeOutput:
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = ""


class Mode(Protocol):
    name: str
    threads: dict[str, int]

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ModeOutput: ...

    def close(self) -> None: ...


class EngineMode:
    """vanilla / sd / card through the in-process runner (one runner, reused for every prompt)."""

    def __init__(self, name: str, target: LoadedModel, draft: LoadedModel | None, config: RunnerConfig,
                 target_threads: int, draft_threads: int | None = None, ignore_eos: bool = False,
                 sampling: SamplingParams | None = None, verify: VerifyPolicy | None = None) -> None:
        self.name = name
        self.ignore_eos = ignore_eos
        self.sampling = sampling or SamplingParams()
        self.verify = verify or VerifyPolicy()
        self.runner = InProcessRunner(target, draft, config)
        self.target_threads = target_threads
        self.threads = {"target": target_threads}
        if draft_threads:
            self.threads["draft"] = draft_threads

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ModeOutput:
        torch.set_num_threads(self.target_threads)
        request = GenerationRequest(tuple(prompt_ids), self.sampling,
                                    StopParams(max_new_tokens=max_new_tokens, ignore_eos=self.ignore_eos),
                                    verify=self.verify)
        result = self.runner.run(request)
        return ModeOutput(result.token_ids, result.stats, result.finish_reason)

    def close(self) -> None:
        self.runner.close()


class _ForwardCounter:
    """Counts a model's forward calls (transformers' generate does not report them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


class HFMode:
    """transformers' own greedy decoding, plain or assisted by the draft."""

    def __init__(self, name: str, target: LoadedModel, draft: LoadedModel | None, threads: int,
                 ignore_eos: bool = False, pld_tokens: int = PLD_TOKENS) -> None:
        from transformers import GenerationConfig

        if name == "hf-assisted" and draft is None:
            raise InvalidArgument("mode hf-assisted needs a draft model")
        self.name = name
        self.target = target
        self.assistant = draft.model if name == "hf-assisted" else None
        self.threads = {"target": threads}
        self._threads = threads
        eos = sorted(target.eos_ids)
        pad = getattr(target.tokenizer, "pad_token_id", None)
        # a fresh config: a checkpoint's own generation defaults (sampling, repetition penalty)
        # would make the comparison with the engine's greedy decoding meaningless
        self.config = GenerationConfig(do_sample=False, eos_token_id=None if ignore_eos else eos,
                                       pad_token_id=pad if pad is not None else (eos or [0])[0])
        if name == "hf-pld":
            self.config.prompt_lookup_num_tokens = pld_tokens

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ModeOutput:
        torch.set_num_threads(self._threads)
        config = copy.copy(self.config)
        config.max_new_tokens = max_new_tokens
        model = self.target.model
        ids = torch.tensor([list(prompt_ids)], dtype=torch.int64, device=model.device)
        counter = _ForwardCounter(model)
        draft_counter = _ForwardCounter(self.assistant) if self.assistant is not None else None
        kwargs = {"assistant_model": self.assistant} if self.assistant is not None else {}
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                     **kwargs)
            wall = time.perf_counter() - t0
        finally:
            counter.close()
            if draft_counter is not None:
                draft_counter.close()
        tokens = out[0, ids.shape[1]:].tolist()
        stats = GenerationStats(mode=self.name, prompt_tokens=len(prompt_ids), new_tokens=len(tokens),
                                wall_s=wall, target_forwards=counter.calls,
                                draft_forwards=draft_counter.calls if draft_counter else 0)
        finish = "eos" if tokens and tokens[-1] in (self.config.eos_token_id or ()) else "length"
        return ModeOutput(tokens, stats, finish)

    def close(self) -> None:
        pass


class ServiceMode:
    """A generation through card-target (which steps card-cache, fed by card-draft) over gRPC.

    Wall time is measured here, around the whole call (the network included); the target's own
    stats (Step round trips, idle times, accepted lengths) come back in the final message.
    """

    def __init__(self, name: str, target_addr: str, threads: dict[str, int],
                 ignore_eos: bool = False, sampling: SamplingParams | None = None,
                 verify: VerifyPolicy | None = None, pools: Mapping[str, str] = SERVICE_POOLS) -> None:
        self.name = name
        self.addr = target_addr
        self.remote_mode, self.draft = service_request(name, pools)
        self.threads = threads
        self.ignore_eos = ignore_eos
        self.sampling = sampling or SamplingParams()
        self.verify = verify or VerifyPolicy()

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> ModeOutput:
        from card.client.remote import generate_remote

        stop = StopParams(max_new_tokens=max_new_tokens, ignore_eos=self.ignore_eos)
        t0 = time.perf_counter()
        v = self.verify
        result = generate_remote(self.addr, list(prompt_ids), stop=stop, mode=self.remote_mode,
                                 sampling=self.sampling, draft=self.draft,
                                 verify=verify_to_msg(v.mode, v.entropy_threshold, v.window))
        stats = result.stats
        stats.wall_s = time.perf_counter() - t0
        stats.mode = self.name
        return ModeOutput(result.token_ids, stats, result.finish_reason)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class ModeSettings:
    """``ngram_tree``: card-ngram's tree (the hardware default at the model-free depth)."""

    tree: TreeParams
    gamma: int
    all_threads: int
    target_threads: int
    draft_threads: int
    ignore_eos: bool = False
    backoff: bool = True
    speculation: str = "auto"  # the target's speculation controller (in process and in the trio)
    ngram: NgramConfig = field(default_factory=NgramConfig)
    ngram_tree: TreeParams | None = None
    exact: bool = True  # the target's batch-invariant forward (--exact), in-process and in the trio
    sampling: SamplingParams = field(default_factory=SamplingParams)  # every mode's (HF modes: greedy)
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)  # card modes' acceptance rule


def build_mode(name: str, target: LoadedModel, draft: LoadedModel | None, s: ModeSettings) -> Mode:
    if name in NEEDS_DRAFT and draft is None:
        raise InvalidArgument(f"mode {name} needs a draft model")
    if name == "vanilla":
        return EngineMode(name, target, None, RunnerConfig(mode=Decoding.VANILLA), s.all_threads,
                          ignore_eos=s.ignore_eos, sampling=s.sampling)
    if name == "sd":
        return EngineMode(name, target, draft, RunnerConfig(mode=Decoding.SD, gamma=s.gamma), s.all_threads,
                          ignore_eos=s.ignore_eos, sampling=s.sampling)
    if name == "card":
        return build_card(name, target, draft, s)
    if name == "card-cascade":
        return build_card(name, target, draft, s, drafter=DrafterKind.CASCADE)
    if name == "card-auto":
        return build_card(name, target, draft, s, mode=Decoding.CARD_AUTO)
    if name == "card-ngram":  # one Python thread drafts: the target keeps the one-model thread count
        config = RunnerConfig(mode=Decoding.CARD, tree=s.ngram_tree or s.tree, backoff=s.backoff,
                              speculation=s.speculation, drafter=DrafterKind.NGRAM,
                              ngram=s.ngram, target_threads=s.all_threads)
        return EngineMode(name, target, None, config, s.all_threads, ignore_eos=s.ignore_eos,
                          sampling=s.sampling, verify=s.verify)
    if name in HF_MODES:
        if not s.sampling.greedy:
            raise InvalidArgument(f"mode {name} runs transformers' greedy generate: drop it, or "
                                  "--temperature 0")
        return HFMode(name, target, draft, s.all_threads, s.ignore_eos)
    raise InvalidArgument(f"unknown mode {name!r}; choose from {', '.join(MODES)}")


def build_card(name: str, target: LoadedModel, draft: LoadedModel, s: ModeSettings,
               drafter: DrafterKind = DrafterKind.NEURAL, mode: Decoding = Decoding.CARD) -> Mode:
    """In-process card with the settings' tree (also each ``--card-variant``, under its own name)."""
    # lending the draft's cores pays only where the target runs faster on more threads
    config = RunnerConfig(mode=mode, tree=s.tree, target_threads=s.target_threads,
                          draft_threads=s.draft_threads, backoff=s.backoff, speculation=s.speculation,
                          lend_cores=s.all_threads > s.target_threads, drafter=drafter, ngram=s.ngram)
    return EngineMode(name, target, draft, config, s.target_threads, s.draft_threads, s.ignore_eos,
                      sampling=s.sampling, verify=s.verify)


def step_ms_by_threads(model: torch.nn.Module, max_threads: int, reps: int = 5) -> dict[int, float]:
    """Median ms of one plain decoding step (one token on a 64-token KV cache) per torch thread
    count. All cores is not always fastest: a 135M model on two cores decodes 1.7x faster on one
    thread than on two (docs/performance.md), its matrices too small to pay the threads' sync."""
    counts = range(1, max_threads + 1) if max_threads <= 8 else sorted({1, 2, 4, 8, max_threads})
    previous = torch.get_num_threads()
    prompt = list(range(1, 65))
    try:
        return {t: verify_costs(model, prompt, range(1), t, reps)[0][1] for t in counts}
    finally:
        torch.set_num_threads(previous)
