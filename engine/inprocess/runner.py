"""Decoding modes in one process: ``vanilla``, ``sd``, ``card`` and ``card-auto`` over the same
target loop.

    runner = InProcessRunner(target, draft, RunnerConfig(mode=Mode.CARD))
    gen = runner.generation(GenerationRequest(prompt_ids, sampling, stop))
    for chunk in runner.stream(gen): print(chunk.text, end="")
    gen.result.stats                     # or, all at once: runner.run(request)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from card.engine.draft.worker import DraftWorker
from card.engine.inprocess.core_lending import CoreLender
from card.engine.inprocess.sources import AutoCard, LocalCard, NgramCard, SyncDraft
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import (
    NGRAM_CHAIN,
    NGRAM_DEPTH,
    ChainDraw,
    DrafterKind,
    GenerationRequest,
    Mode,
    NgramConfig,
    TreeParams,
)
from card.engine.shared.errors import FailedPrecondition, InvalidArgument
from card.engine.shared.kv_pool import SHORTEST_DEFAULT_LEN, KVPool
from card.engine.shared.ngram_stats import NgramTable, shared_table
from card.engine.shared.static_step import STEP_MODES
from card.engine.shared.tree import Layer
from card.engine.target.chain_source import ChainSource, NoDraft
from card.engine.target.drafting_policy import DraftingConfig, DraftingPolicy
from card.engine.target.generation import Chunk, Generation, GenerationResult
from card.engine.target.grammar import compiler_for
from card.engine.target.scheduler import TargetEngine, run_alone


@dataclass(frozen=True)
class RunnerConfig:
    """mode; tree shape (card); gamma (sd chain length); torch threads per model (None = all);
    cache_device for card's tree; lend_cores (card on the
    CPU: the target borrows the draft's threads while the draft idles, card.engine.inprocess.core_lending);
    backoff (pause a draft that misses or slows the target: the drafting policy's pace rule) and
    calibration_steps (card through the worker: plain steps that open each generation to measure
    the target's pace alone, against which drafting is judged); drafter (card: what grows the
    trees, engine.shared.config.DrafterKind) and ngram (the n-gram settings of the kinds that
    use them); speculation: the drafting policy's regime (card.engine.target.drafting_policy:
    auto, always, never), one policy for the runner's life so what it measured serves every
    generation; ``backoff=False`` makes it ``always`` without the pace rule."""

    mode: Mode = Mode.CARD
    tree: TreeParams = field(default_factory=TreeParams)
    gamma: int = 4
    target_threads: int | None = None
    draft_threads: int | None = None
    cache_device: str = "cpu"
    lend_cores: bool = True
    backoff: bool = True
    calibration_steps: int = 4
    draft_slots: int = 8  # card: sessions the draft worker grows at once (one forward per round)
    drafter: DrafterKind = DrafterKind.NEURAL
    ngram: NgramConfig = field(default_factory=NgramConfig)
    speculation: str = "auto"
    decode_step: str = "eager"  # the target's decoding step (card.engine.shared.static_step)
    # the target keeps one KV slot from one generation to the next, and a prompt that starts with
    # the previous one's whole prefill chunks reuses their keys and values (the same bits)
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        self.policy()  # validates
        if not isinstance(self.mode, Mode) or (self.mode is Mode.CARD_AUTO
                                               and self.drafter is not DrafterKind.NEURAL):
            raise InvalidArgument(f"mode must be a Mode (card-auto: the neural drafter), got {self.mode!r}")
        if not isinstance(self.drafter, DrafterKind):
            raise InvalidArgument(f"drafter must be a DrafterKind, got {self.drafter!r}")
        self.drafter.check_mode(self.mode)
        if self.gamma < 1:
            raise InvalidArgument(f"gamma must be >= 1, got {self.gamma}")
        if self.decode_step not in STEP_MODES:
            raise InvalidArgument(f"decode_step must be one of {', '.join(STEP_MODES)}, "
                                  f"got {self.decode_step!r}")
        if self.draft_slots < 1:
            raise InvalidArgument(f"draft_slots must be >= 1, got {self.draft_slots}")
        if self.calibration_steps < 0:
            raise InvalidArgument(f"calibration_steps must be >= 0, got {self.calibration_steps}")

    def policy(self) -> DraftingConfig:
        """The drafting policy's settings (calibration: card through its worker only)."""
        return DraftingConfig(speculation=self.speculation if self.backoff else "always",
                              pace_rule=self.backoff,
                              calibration=self.calibration_steps if self.mode is Mode.CARD else 0)


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft may serve a target only if their tokenizers give the same ids."""
    if draft.fingerprint != target.fingerprint:
        raise FailedPrecondition(
            f"draft model {draft.name} has tokenizer {draft.fingerprint} but target model "
            f"{target.name} has tokenizer {target.fingerprint}; a draft must share the target's tokenizer"
        )


class InProcessRunner:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None, config: RunnerConfig) -> None:
        self.target = target
        self.draft = draft
        self.config = config
        self.worker: DraftWorker | None = None
        self._cards: weakref.WeakSet[LocalCard] = weakref.WeakSet()
        self._table: NgramTable | None = None
        self._table_built = False
        if config.mode is not Mode.VANILLA and config.drafter.needs_model:  # auto needs its draft model too
            if draft is None:
                raise InvalidArgument(f"mode {config.mode.value} needs a draft model")
            check_compatible(target, draft)
        if config.target_threads:
            torch.set_num_threads(config.target_threads)
        self.policy = DraftingPolicy(config.policy())
        self._engine: TargetEngine | None = None  # prefix caching: one engine of one slot, kept

    def _source(self, kv_len: int, draw: ChainDraw | None = None) -> ChainSource:
        """The chain source of one generation; ``draw``: its chains are drawn (rejection)."""
        cfg = self.config
        if cfg.mode is Mode.VANILLA:
            return NoDraft()
        if cfg.mode is Mode.SD:
            assert self.draft is not None
            return SyncDraft(self.draft.model, cfg.gamma, kv_len, draw)
        if cfg.drafter is DrafterKind.NGRAM:
            return self._ngram_card(kv_len, draw)
        if self.worker is None:
            self.worker = self._new_worker()
            self.worker.start()
        source = self._new_card(self.worker, draw)
        self._cards.add(source)
        if cfg.mode is Mode.CARD_AUTO:
            return AutoCard(self._ngram_card(kv_len, draw), source)
        return source

    def _ngram_card(self, kv_len: int, draw: ChainDraw | None) -> NgramCard:
        cfg = self.config
        # auto: the model-free drafter's own depth and chain beside the draft model's tree
        tree = cfg.tree if cfg.drafter is DrafterKind.NGRAM else cfg.tree.with_overrides(
            max_depth=NGRAM_DEPTH, max_chain=max(cfg.tree.max_chain, NGRAM_CHAIN))
        return NgramCard(tree, self._vocab, cfg.ngram, self._ngram_table(), kv_len, draw)

    @property
    def _vocab(self) -> int:
        return self.target.model.get_input_embeddings().num_embeddings

    def _ngram_table(self) -> NgramTable | None:
        """The runner's one shared n-gram table (cascade: its worker's), warmed with the target's
        tokenizer; built on first use."""
        if not self._table_built:
            encode = lambda text: self.target.tokenizer(text)["input_ids"]  # noqa: E731
            self._table = shared_table(self._vocab, self.config.ngram, encode)
            self._table_built = True  # None is a built table too: --ngram-table-mb 0
        return self._table

    def _new_worker(self) -> DraftWorker:
        cfg = self.config
        window = self.target.context_window
        kind = cfg.drafter
        assert self.draft is not None
        # rows per slot: on the CPU the target's whole context window (a slot's pages are touched
        # only as far as its session writes, card.engine.shared.kv_pool); on an accelerator, where the
        # allocation is real, the services' shortest default (a longer session is not drafted)
        on_cpu = next(self.draft.model.parameters()).device.type == "cpu"
        return DraftWorker.of_kind(kind, self.draft.model, cfg.tree, self._publish, slots=cfg.draft_slots,
                                   max_len=window if on_cpu else min(window, SHORTEST_DEFAULT_LEN),
                                   threads=cfg.draft_threads, name=self.draft.name, ngram_config=cfg.ngram,
                                   ngram=self._ngram_table() if kind.uses_ngram else None)

    def _new_card(self, worker: DraftWorker, draw: ChainDraw | None) -> LocalCard:
        cfg = self.config
        return LocalCard(worker, cfg.tree, cfg.cache_device, lender=self._lender(worker), draw=draw)

    def _lender(self, worker: DraftWorker) -> CoreLender | None:
        cfg = self.config
        if self.draft is None or cfg.drafter is DrafterKind.NGRAM:
            return None  # a model-free drafter holds no cores worth lending
        on_cpu = all(next(m.model.parameters()).device.type == "cpu" for m in (self.target, self.draft))
        if not (cfg.lend_cores and cfg.draft_threads and on_cpu):
            return None
        own = cfg.target_threads or torch.get_num_threads()
        return CoreLender(self.target.model, own, cfg.draft_threads, worker.idle)

    def _publish(self, session_id: str, layer: Layer) -> None:
        for card in list(self._cards):
            card.publish(session_id, layer)  # each card keeps only its own session's layers

    def generation(self, request: GenerationRequest) -> Generation:
        return Generation(
            request,
            self._source(Generation.kv_rows(request, self.target.context_window), request.chain_draw),
            eos_ids=self.target.eos_ids,
            decode=self.target.decode,
            context_window=self.target.context_window,
            mode=self.config.mode.value,
            model_name=self.target.name,
            vocab_size=self._vocab,
            grammars=compiler_for(self.target.tokenizer, self._vocab, self.target.eos_ids),
            grammar_drafts=self.config.mode is not Mode.VANILLA,
        )

    def stream(self, gen: Generation) -> Iterator[Chunk]:
        """Run ``gen`` on the target model, yielding its chunks; ``gen.result`` is set at the end."""
        engine = self._cached_engine(gen.kv_len)
        if engine is None:
            yield from run_alone(self.target.model, gen, exact=self.target.exact, policy=self.policy,
                                 decode_step=self.config.decode_step)
        else:
            yield from engine.stream(gen)

    def run(self, request: GenerationRequest) -> GenerationResult:
        gen = self.generation(request)
        for _ in self.stream(gen):
            pass
        assert gen.result is not None
        return gen.result

    def _cached_engine(self, kv_len: int) -> TargetEngine | None:
        """The runner's engine of one prefix-cached slot, idle and long enough for ``kv_len``
        rows; None (a fresh engine of its own runs the generation) without prefix caching or
        while another generation of this runner is streaming."""
        if not self.config.prefix_caching:
            return None
        engine = self._engine
        if engine is not None and not engine.idle:
            return None
        if engine is None or engine.pool.max_len < kv_len:
            model = self.target.model
            window = self.target.context_window
            # on the CPU the whole window costs address space only (card.engine.shared.kv_pool);
            # an accelerator's allocation is real: as long as the longest generation so far
            on_cpu = next(model.parameters()).device.type == "cpu"
            rows = window if on_cpu else min(window, max(kv_len, SHORTEST_DEFAULT_LEN))
            self._engine = engine = TargetEngine(
                model, KVPool(model, slots=1, max_len=max(rows, kv_len, 2), prefix_caching=True),
                exact=self.target.exact, policy=self.policy, decode_step=self.config.decode_step)
        return engine

    def close(self) -> None:
        self._engine = None
        if self.worker is not None:
            self.worker.close()
            self.worker = None
