"""The decoding modes a benchmark compares, each behind one interface: ``run(prompt_ids, budget)``.

    vanilla, sd, card   the engine in this process (card.engine.inprocess.runner.InProcessRunner)
    card-ngram          card with the model-free n-gram drafter (card.engine.draft.ngram), no draft model
    card-cascade        card with the draft model and the n-gram statistics beneath it
    card-auto           card choosing per session between card-ngram and card (the drafting policy)
    card-NAME           card on the tree of ``--card-variant NAME:...``
    hf                  transformers' plain greedy ``model.generate`` (cross-check of vanilla)
    hf-assisted         transformers' assisted generation with the same draft, greedy
    hf-pld              transformers' prompt lookup decoding (``prompt_lookup_num_tokens``), greedy
    svc-vanilla, svc-card   the same through the real services (a LocalTrio: redis, card-cache,
                        card-draft, card-target as subprocesses) with ``--services``
    svc-ngram, svc-cascade  through the same trio, a model-free / a cascade worker's pool
    svc-auto            through the same trio, mode card-auto: per request the cache's model-free
                        lookup alone or the draft model's worker, whichever commits faster
    MODE+POLICY         a card mode under another acceptance rule (``card+loose``, ``svc-card+rejection``)

A name is parsed once (``BenchMode.parse``); everything downstream asks the mode's fields. Every
mode returns a ``GenerationStats`` (engine/shared/stats.py) and the generated token ids, so one
report covers all of them. Each mode sets the torch thread count it runs best with before it runs:
modes that use one model at a time get every core; card splits the cores between the target (this
thread) and the draft worker thread.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

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
    Verify,
    VerifyPolicy,
)
from card.engine.shared.config import Mode as Decoding
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.kv_pool import KVPool, Segment, forward
from card.engine.shared.stats import GenerationStats

Decoder = Literal["vanilla", "sd", "card", "card-auto", "hf"]  # the engine's Mode, or transformers
_NEURAL, _NGRAM = DrafterKind.NEURAL, DrafterKind.NGRAM
_CASCADE = DrafterKind.CASCADE
# (decoder, drafter, through the services) of every named mode; hf: the draft model assists
# (neural) or the prompt is looked up (ngram)
_NAMES: dict[str, tuple[Decoder, DrafterKind | None, bool]] = {
    "vanilla": ("vanilla", None, False), "sd": ("sd", _NEURAL, False), "card": ("card", _NEURAL, False),
    "card-ngram": ("card", _NGRAM, False), "card-cascade": ("card", _CASCADE, False),
    "card-auto": ("card-auto", _NEURAL, False),
    "hf": ("hf", None, False), "hf-assisted": ("hf", _NEURAL, False), "hf-pld": ("hf", _NGRAM, False),
    "svc-vanilla": ("vanilla", None, True), "svc-card": ("card", _NEURAL, True),
    "svc-ngram": ("card", _NGRAM, True), "svc-cascade": ("card", _CASCADE, True),
    "svc-auto": ("card-auto", _NEURAL, True),
}
_NAME_OF = {key: name for name, key in _NAMES.items()}
MODE_NAMES = tuple(_NAMES)
_VARIANT = re.compile(r"[\w.-]+")
_CARD_DRAFTERS = [n.removeprefix("card-") for n in _NAMES if n.startswith("card-")]


@dataclass(frozen=True)
class BenchMode:
    """One card-bench mode: ``[svc-]DECODER[-DRAFTER | -VARIANT][+POLICY]`` parsed once (``parse``),
    its name again from ``name``. ``variant``: in-process card on a ``--card-variant``'s tree;
    ``verify``: the card modes' acceptance rule (the thresholds are the run's ``--loose-*``)."""

    decoder: Decoder
    drafter: DrafterKind | None = None
    services: bool = False  # through a trio's card-target, else in this process
    variant: str = ""
    verify: Verify = Verify.EXACT

    def __post_init__(self) -> None:
        key = (self.decoder, self.drafter, self.services)
        if key not in _NAME_OF:
            raise InvalidArgument(f"no card-bench mode runs {key}")
        if self.variant and (key != ("card", _NEURAL, False) or not _VARIANT.fullmatch(self.variant)
                             or f"card-{self.variant}" in _NAMES):
            raise InvalidArgument(f"card-{self.variant} is no tree variant: a variant's NAME (letters, "
                                  f"digits, _ . -) other than {', '.join(_CARD_DRAFTERS)}")
        if self.verify is not Verify.EXACT and not self.speculates:
            raise InvalidArgument(f"{_NAME_OF[key]}+{self.verify.value}: only card modes take an "
                                  "acceptance rule")

    @classmethod
    def parse(cls, text: str) -> BenchMode:
        """InvalidArgument (a usage error) naming the grammar for anything else."""
        name, plus, policy = text.strip().partition("+")
        variant = ""
        key = _NAMES.get(name)
        if key is None and name.startswith("card-"):
            key, variant = _NAMES["card"], name.removeprefix("card-")
        if key is None or (plus and not policy):
            raise InvalidArgument(
                f"unknown mode {text!r}; choose from {', '.join(_NAMES)}, card-NAME (a --card-variant), "
                f"or a card mode under another acceptance rule, MODE+{'|'.join(v.value for v in Verify)}")
        return cls(*key, variant=variant, verify=Verify.parse(policy) if plus else Verify.EXACT)

    @property
    def name(self) -> str:
        name = _NAME_OF[(self.decoder, self.drafter, self.services)]
        if self.variant:
            name += f"-{self.variant}"
        return name if self.verify is Verify.EXACT else f"{name}+{self.verify.value}"

    def __str__(self) -> str:
        return self.name

    @property
    def needs_draft(self) -> bool:
        """Runs the draft model in this process."""
        return not self.services and self.drafter in (_NEURAL, _CASCADE)

    @property
    def speculates(self) -> bool:
        """A card mode: the target verifies drafted chains (the drafting policy may pick the drafter)."""
        return self.decoder in ("card", "card-auto")


VANILLA = BenchMode("vanilla")  # the reference: speedups and exactness are measured against it
SVC_VANILLA = BenchMode("vanilla", services=True)  # the reference under load
SVC_CARD = BenchMode("card", _NEURAL, services=True)
DEFAULT_SERVICE_MODES = (SVC_VANILLA, SVC_CARD)  # what --services adds beside in-process modes
# The draft pool each speculating service mode names, in a trio card-bench starts: one trio serves
# them all, the model-free and cascade workers beside the draft model's (card.client.bench.cli)
# (svc-auto: mode card-auto, per request the cache's model-free lookup alone or the draft model's worker)
SERVICE_POOLS = {_NEURAL: "bench-draft", _NGRAM: "bench-ngram", _CASCADE: "bench-cascade"}


def service_request(mode: BenchMode, pools: Mapping[DrafterKind, str]) -> tuple[str, str | None]:
    """(the GenerateRequest's mode, its draft) of a service mode; ``pools``: SERVICE_POOLS in a
    trio card-bench started, empty for a running target (its own routing)."""
    if mode.drafter is None:
        return "vanilla", None
    return mode.decoder, pools.get(mode.drafter)


# hf-pld: candidate tokens per lookup (transformers' documented example uses 10; its matching
# n-gram size keeps its default, 2)
PLD_TOKENS = 10


@dataclass(frozen=True)
class ModeOutput:
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = ""


class BuiltMode(Protocol):
    """A BenchMode built to run prompts (EngineMode, HFMode, ServiceMode), under its name."""

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

    def __init__(self, mode: BenchMode, target: LoadedModel, draft: LoadedModel | None, threads: int,
                 ignore_eos: bool = False, pld_tokens: int = PLD_TOKENS) -> None:
        from transformers import GenerationConfig

        self.name = mode.name
        self.target = target
        self.assistant = draft.model if draft is not None and mode.drafter is _NEURAL else None
        self.threads = {"target": threads}
        self._threads = threads
        eos = sorted(target.eos_ids)
        pad = getattr(target.tokenizer, "pad_token_id", None)
        # a fresh config: a checkpoint's own generation defaults (sampling, repetition penalty)
        # would make the comparison with the engine's greedy decoding meaningless
        self.config = GenerationConfig(do_sample=False, eos_token_id=None if ignore_eos else eos,
                                       pad_token_id=pad if pad is not None else (eos or [0])[0])
        if mode.drafter is _NGRAM:
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

    def __init__(self, mode: BenchMode, target_addr: str, threads: dict[str, int], ignore_eos: bool = False,
                 sampling: SamplingParams | None = None, verify: VerifyPolicy | None = None,
                 pools: Mapping[DrafterKind, str] = SERVICE_POOLS) -> None:
        self.name = mode.name
        self.addr = target_addr
        self.remote_mode, self.draft = service_request(mode, pools)
        self.threads = threads
        self.ignore_eos = ignore_eos
        self.sampling = sampling or SamplingParams()
        self.verify = dataclasses.replace(verify or VerifyPolicy(), mode=mode.verify)

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
    """``ngram_tree``: card-ngram's tree (the hardware default at the model-free depth);
    ``variants``: the tree of each ``--card-variant`` by its name."""

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
    variants: Mapping[str, TreeParams] = field(default_factory=dict)
    exact: bool = True  # the target's batch-invariant forward (--exact), in-process and in the trio
    sampling: SamplingParams = field(default_factory=SamplingParams)  # every mode's (HF modes: greedy)
    # the card modes' loose thresholds (--loose-*); each mode's own rule is its BenchMode.verify
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)


def build_mode(mode: BenchMode, target: LoadedModel, draft: LoadedModel | None, s: ModeSettings) -> BuiltMode:
    """An in-process mode (InvalidArgument where it needs the draft model and has none)."""
    if mode.needs_draft and draft is None:
        raise InvalidArgument(f"mode {mode} needs a draft model")
    if mode.decoder == "hf":
        if not s.sampling.greedy:
            raise InvalidArgument(f"mode {mode} runs transformers' greedy generate: drop it, or "
                                  "--temperature 0")
        return HFMode(mode, target, draft, s.all_threads, s.ignore_eos)
    if not mode.speculates:
        return EngineMode(mode.name, target, draft if mode.needs_draft else None,
                          RunnerConfig(mode=Decoding(mode.decoder), gamma=s.gamma), s.all_threads,
                          ignore_eos=s.ignore_eos, sampling=s.sampling)
    verify = dataclasses.replace(s.verify, mode=mode.verify)
    if mode.drafter is _NGRAM:  # one Python thread drafts: the target keeps the one-model thread count
        config = RunnerConfig(mode=Decoding.CARD, tree=s.ngram_tree or s.tree, backoff=s.backoff,
                              speculation=s.speculation, drafter=_NGRAM, ngram=s.ngram,
                              target_threads=s.all_threads)
        return EngineMode(mode.name, target, None, config, s.all_threads, ignore_eos=s.ignore_eos,
                          sampling=s.sampling, verify=verify)
    # lending the draft's cores pays only where the target runs faster on more threads
    tree = s.variants[mode.variant] if mode.variant else s.tree
    config = RunnerConfig(mode=Decoding(mode.decoder), tree=tree,
                          target_threads=s.target_threads, draft_threads=s.draft_threads, backoff=s.backoff,
                          speculation=s.speculation, lend_cores=s.all_threads > s.target_threads,
                          drafter=mode.drafter or _NEURAL, ngram=s.ngram)
    return EngineMode(mode.name, target, draft, config, s.target_threads, s.draft_threads, s.ignore_eos,
                      sampling=s.sampling, verify=verify)


def step_ms_by_threads(model: torch.nn.Module, max_threads: int, reps: int = 5) -> dict[int, float]:
    """Median ms of one plain decoding step (one token on a 64-token KV cache) per torch thread
    count. All cores is not always fastest: a 135M model on two cores decodes 1.7x faster on one
    thread than on two (docs/performance.md), its matrices too small to pay the threads' sync."""
    counts = range(1, max_threads + 1) if max_threads <= 8 else sorted({1, 2, 4, 8, max_threads})
    previous = torch.get_num_threads()
    pool = KVPool(model, slots=1, max_len=65)
    forward(model, pool, [Segment(0, 0, 64)], torch.arange(1, 65), torch.empty(0, dtype=torch.int64))
    token, row = torch.tensor([64]), torch.zeros(1, dtype=torch.int64)

    def step() -> float:  # row 64 is simply overwritten by the next step
        t0 = time.perf_counter()
        forward(model, pool, [Segment(0, 64, 1)], token, row)
        return (time.perf_counter() - t0) * 1e3

    try:
        result = {}
        for threads in counts:
            torch.set_num_threads(threads)
            step()  # warm-up: oneDNN / MKL pick their kernels per shape and thread count
            result[threads] = statistics.median(step() for _ in range(reps))
        return result
    finally:
        torch.set_num_threads(previous)
