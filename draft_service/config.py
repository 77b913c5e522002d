"""Configuration of a draft worker, built once from flags and CARD_DRAFT_* variables."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from card.common.drafts import POOL_NAME, pool_name
from card.common.tls import TlsConfig
from card.engine.draft.drafter import tree_rows
from card.engine.draft.static_tree import DRAFT_STEP_MODES
from card.engine.loading.models import ModelConfig
from card.engine.shared.config import DrafterKind, NgramConfig, TreeParams, tree_params
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.kv_pool import DEVICE_KV_SHARE, PoolShape, check_sizing, size_pool

# A model-free worker holds no KV cache: many more sessions, and longer ones, cost it little
NGRAM_CAPACITY = 64
NGRAM_MAX_MODEL_LEN = 32768


def default_pool(model_spec: str, quantize: str = "none", cascade: bool = False) -> str:
    """The pool of a worker started without --pool: its model and how it runs it, e.g.
    ``qwen2.5-coder-0.5b-int8`` (every worker of one model, quantization and kind is one pool)."""
    base = Path(model_spec.rstrip("/")).name or model_spec
    base = re.sub(r"\.gguf$", "", base)[:80]  # names of <= 128 characters, with the host and pid
    if quantize != "none":
        base = f"{base}-{quantize}"
    if cascade:
        base = f"{base}-ngram"
    return pool_name(base)


def default_worker_name(model_spec: str, quantize: str = "none", cascade: bool = False) -> str:
    """``<pool>-<host>-<pid>``: unique per process, readable in ``card-client drafts``."""
    host = socket.gethostname().split(".")[0]
    return pool_name(f"{default_pool(model_spec, quantize, cascade)}-{host}-{os.getpid()}")


@dataclass(frozen=True)
class DraftConfig:
    """capacity: most sessions grown at once, all in one forward per round (KV slots, unless
    kv_cache_gb holds fewer; the registry hears the slots). max_model_len: committed tokens per
    slot (a longer session is not drafted; the target decodes it alone); None = the model's
    context window, at most 4096. Each slot also holds its tree (tree width x max depth rows).
    drafter: what grows the trees (neural, cascade, or ngram: model-free, drafting for the
    tokenizer ``tokenizer``); ngram: the n-gram settings of a cascade or model-free worker."""

    cache_addr: str
    model: ModelConfig
    name: str
    pool: str = "default"  # requests name pools (card-client --draft POOL); see default_pool
    drafter: DrafterKind = DrafterKind.NEURAL
    tree: TreeParams = field(default_factory=TreeParams)
    ngram: NgramConfig | None = None
    tokenizer: str | None = None
    capacity: int = 8
    max_model_len: int | None = None
    kv_cache_gb: float | None = None
    # without kv_cache_gb, on an accelerator: the share of the memory free once the model is loaded
    # that keys and values may take (vLLM's --gpu-memory-utilization, which counts the whole card)
    kv_cache_memory_fraction: float = DEVICE_KV_SHARE
    # finished sessions' text kept for a conversation's next turn beyond the live slots
    # (kv_pool.CACHED_PER_SLOT per slot): on the CPU without kv_cache_gb at most this many GB
    # resident; with a KV budget, as many as it holds; 0: none (free live slots still cache)
    prefix_cache_gb: float = 2.0
    threads: int | None = None
    # tree rows at static shapes (card.engine.draft.static_tree): eager, static, graphs, auto
    decode_step: str = "auto"
    draft_token: str | None = field(default=None, repr=False)  # presented to the cache (a secret)
    pool_token: str | None = field(default=None, repr=False)  # its pool's, at RegisterDraft (a secret)
    tls: TlsConfig = field(default_factory=TlsConfig)  # dials the cache with it; serves the health port
    health_port: int | None = None  # plaintext grpc.health.v1 alone, for probes that cannot speak TLS
    host: str = "127.0.0.1"
    port: int = 50053
    metrics_port: int = 9093
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    json_logs: bool = False
    # reconnect backoff after the cache goes away (seconds, doubling up to the max)
    retry_initial_s: float = 0.5
    retry_max_s: float = 10.0
    # on SIGTERM: hand the live sessions over to other workers for at most this long, then exit
    drain_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if not self.cache_addr:
            raise InvalidArgument(
                "the cache address is required (--cache HOST:PORT or CARD_DRAFT_CACHE_ADDR)")
        if not self.name:
            raise InvalidArgument("the worker name must not be empty")
        if not POOL_NAME.fullmatch(self.pool):
            raise InvalidArgument(f"a pool name is 1-128 characters of A-Z a-z 0-9 . _ -, got {self.pool!r}")
        if self.drain_timeout_s < 0:
            raise InvalidArgument(f"the drain timeout must be >= 0, got {self.drain_timeout_s}")
        if self.drafter.uses_ngram and self.ngram is None:
            raise InvalidArgument(f"a {self.drafter.value} draft needs its n-gram settings")
        if self.model_free:
            if not self.tokenizer:
                raise InvalidArgument("a model-free draft (--model ngram) drafts for a target's tokenizer: "
                                      "give --tokenizer (the target's model spec or tokenizer folder)")
        elif self.tokenizer:
            raise InvalidArgument("--tokenizer is for --model ngram; a draft model brings its own")
        if self.capacity < 1:
            raise InvalidArgument(f"capacity must be >= 1, got {self.capacity}")
        check_sizing(self.kv_cache_gb, self.max_model_len, self.kv_cache_memory_fraction)
        if not self.prefix_cache_gb >= 0:
            raise InvalidArgument(f"prefix-cache-gb must be >= 0, got {self.prefix_cache_gb}")
        if self.decode_step not in DRAFT_STEP_MODES:
            raise InvalidArgument(f"decode-step must be one of {', '.join(DRAFT_STEP_MODES)}, "
                                  f"got {self.decode_step!r}")
        if self.threads is not None and self.threads < 1:
            raise InvalidArgument(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise InvalidArgument("ports must be in [0, 65535]")

    @classmethod
    def from_options(cls, *, model: str, cascade: str, quantize: str, dtype: str, device: str,
                     name: str | None, pool: str | None, capacity: int | None, tree_flags: dict[str, object],
                     ngram: NgramConfig, draft_token: str | None, cpu_linear: str = "auto",
                     **options: object) -> DraftConfig:
        """The config of card-draft's flags (one keyword per flag; every other flag is a field):
        the drafter kind is parsed here, once."""
        kind = DrafterKind.from_flags(model, cascade)
        device = device if kind.needs_model else "cpu"
        return cls(model=ModelConfig(model, dtype, device, quantize, cpu_linear=cpu_linear), drafter=kind,
                   name=name or default_worker_name(model, quantize, kind is DrafterKind.CASCADE),
                   pool=pool or default_pool(model, quantize, kind is DrafterKind.CASCADE),
                   tree=tree_params(device, kind, **tree_flags), ngram=ngram if kind.uses_ngram else None,
                   capacity=capacity or (8 if kind.needs_model else NGRAM_CAPACITY),
                   draft_token=draft_token or None, **options)  # type: ignore[arg-type]

    @property
    def model_free(self) -> bool:
        return self.drafter is DrafterKind.NGRAM

    @property
    def label(self) -> str:
        """What the cache's registry shows as this worker's model."""
        return self.drafter.label(self.model.label)

    def kv_sizing(self, context_window: int, bytes_per_token: int,
                  free_bytes: int | None = None) -> PoolShape:
        """Slots and committed rows per slot of the worker's KV cache (the target's rule,
        kv_pool.size_pool); the tree's rows come on top, within the budget. ``free_bytes``: the
        accelerator's free memory, None on the CPU."""
        return size_pool(self.capacity, self.max_model_len, context_window, bytes_per_token,
                         self.kv_cache_gb, extra_rows=tree_rows(self.tree), free_bytes=free_bytes,
                         slots_flag="--capacity", memory_fraction=self.kv_cache_memory_fraction,
                         prefix_cache_gb=self.prefix_cache_gb)

    def kv_shape(self, context_window: int, bytes_per_token: int) -> tuple[int, int]:
        shape = self.kv_sizing(context_window, bytes_per_token)
        return shape.slots, shape.max_len
