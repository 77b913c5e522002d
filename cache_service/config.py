"""The cache service's settings, built once from CLI flags / CARD_CACHE_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from card.cache_service.registry import MAX_CAPACITY, MAX_LAYER_STREAMS
from card.cache_service.store import redact_url
from card.common.drafts import parse_pool_tokens, parse_pool_weights
from card.common.tls import TlsConfig
from card.engine.loading.devices import resolve_device
from card.engine.shared.config import TreeParams, tree_params
from card.engine.shared.errors import InvalidArgument


@dataclass(frozen=True)
class CacheConfig:
    """host/port: where gRPC listens (port 0 = OS-chosen). 127.0.0.1 by default so a local run
    is not exposed; containers and Kubernetes set CARD_CACHE_HOST=0.0.0.0.

    redis_url: ``redis://...`` or ``memory://`` (in-process store, single machine only); a password
        goes in it, ``redis://:PASSWORD@host:port/db`` (never shown: ``store.redact_url``).
    allow_memory_fallback: use the in-process store when Redis is unreachable at startup.
    require_redis: refuse to start while Redis is unreachable (False: start and serve; Redis's
        health name says NOT_SERVING and records wait until it answers).
    device: where the trees live (resolved, never ``auto``), e.g. "cpu", "cuda:0".
    session_ttl_s: how long finished-session records stay in Redis (default an hour: they are for
        debugging; each is a bounded summary, so Redis holds about one per session of the last TTL).
    session_idle_timeout_s: a session with no Step or keepalive for this long is closed as
        abandoned (its target died without closing it); a target's own (OpenSession) is shorter,
        this caps it; 0 = no cap.
    heartbeat_interval_s: how often draft workers heartbeat; a worker expires after 3 missed.
    health_check_interval_s: how often Redis is probed (the health name ``card.v1.CacheService.redis``
        follows it; the cache's own health does not).
    tree: its chain fields (max_chain, b_extension, min_path_prob) shape the chains handed to the
        target (card.engine.shared.tree.best_chain); a session's ChainPolicy goes over them. The tree's shape
        (width, branch, depth) is the draft workers' and unused here.
    grpc_threads: server threads for everything but the drafts' streams (Step, OpenSession,
        heartbeats, Status); each registered draft gets its own threads for its streams on top
        (``server_threads``), so that no number of drafts can take these.
    max_drafts: most draft workers registered at once (RegisterDraft refuses more).
    max_draft_capacity: most sessions one worker is given, whatever capacity it declares (a draft is
        a guest: the least-loaded worker takes each new session, so a declared 4096 would win them all).
    drop_cooldown_s: how long a worker that dropped a session is not offered it again (others are
        at once; after it, any is).
    pool_tokens: ((pool, token), ...): a worker registers into a listed pool only with its token,
        and into no other pool; () = every pool open to the draft token's holders.
    pool_weights: how unnamed sessions split between pools ((pool, weight), ...; () = least loaded).
    model_free_chains: where a session's tree holds nothing to verify (right after a miss, while
        its draft restarts; no worker free), answer the Step with a model-free continuation of the
        session's own text (card.engine.shared.ngram_stats.PromptLookup) instead of an empty chain.
    tls: the certificate served on the gRPC port (card.common.tls; none = plaintext).
    """

    host: str = "127.0.0.1"
    port: int = 50052
    # may hold Redis's password (redis://:PASSWORD@host): never in a repr; store.redact_url to show it
    redis_url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    redis_prefix: str = "card:"
    allow_memory_fallback: bool = False
    require_redis: bool = True
    device: str = "cpu"
    metrics_port: int = 9092
    metrics_host: str = "127.0.0.1"
    session_ttl_s: int = 3600
    session_idle_timeout_s: float = 600.0
    heartbeat_interval_s: float = 2.0
    health_check_interval_s: float = 2.0
    tree: TreeParams = field(default_factory=TreeParams)
    grpc_threads: int = 64
    max_drafts: int = 128
    max_draft_capacity: int = 64
    drop_cooldown_s: float = 60.0
    pool_tokens: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    pool_weights: tuple[tuple[str, float], ...] = ()
    model_free_chains: bool = True
    # who may call what (card.common.auth.CACHE_ROLES); None = that role's RPCs are open
    draft_token: str | None = field(default=None, repr=False)
    target_token: str | None = field(default=None, repr=False)
    # Drain, SetPoolWeights (and Status); None with a target token: refused (card.common.auth)
    operator_token: str | None = field(default=None, repr=False)
    tls: TlsConfig = field(default_factory=TlsConfig)
    health_port: int | None = None  # plaintext grpc.health.v1 alone, for probes that cannot speak TLS
    log_level: str = "INFO"
    json_logs: bool = False

    @classmethod
    def from_options(cls, *, device: str, tree_flags: dict[str, Any], draft_token: str | None,
                     target_token: str | None, operator_token: str | None = None, pool_weights: str = "",
                     pool_tokens: str | None = None, **options: object) -> CacheConfig:
        """The config of card-cache's flags (one keyword per flag; every other flag is a field).
        The cache sits with the target: its hardware says how long a chain pays to verify."""
        return cls(device=str(resolve_device(device)), tree=tree_params(device, **tree_flags),
                   health_check_interval_s=min(2.0, float(options.get("heartbeat_interval_s", 2.0))),  # type: ignore[arg-type]
                   draft_token=draft_token or None, target_token=target_token or None,
                   operator_token=operator_token or None, pool_weights=parse_pool_weights(pool_weights),
                   pool_tokens=parse_pool_tokens(pool_tokens or ""), **options)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"metrics port must be in [0, 65535], got {self.metrics_port}")
        if self.session_ttl_s < 1:
            raise InvalidArgument(f"session TTL must be >= 1 s, got {self.session_ttl_s}")
        if self.session_idle_timeout_s < 0:
            raise InvalidArgument(f"session idle timeout must be >= 0, got {self.session_idle_timeout_s}")
        if self.heartbeat_interval_s <= 0 or self.health_check_interval_s <= 0:
            raise InvalidArgument("heartbeat and health-check intervals must be > 0")
        if self.grpc_threads < 4:
            raise InvalidArgument(f"grpc_threads must be >= 4, got {self.grpc_threads}")
        if not 1 <= self.max_drafts <= 4096:
            raise InvalidArgument(f"max_drafts must be in [1, 4096], got {self.max_drafts}")
        if not 1 <= self.max_draft_capacity <= MAX_CAPACITY:
            raise InvalidArgument(f"max_draft_capacity must be in [1, {MAX_CAPACITY}], "
                                  f"got {self.max_draft_capacity}")
        if not 0 <= self.drop_cooldown_s <= 86400:
            raise InvalidArgument(f"drop_cooldown_s must be in [0, 86400], got {self.drop_cooldown_s}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://", "memory://")):
            raise InvalidArgument(
                f"redis URL must start with redis://, rediss://, unix:// or memory://, got "
                f"{redact_url(self.redis_url)!r}"
            )

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def server_threads(self) -> int:
        """The gRPC pool: ``grpc_threads`` plus every stream the registered drafts may hold (one
        Commands and at most MAX_LAYER_STREAMS PublishLayers each); no call is taken beyond it."""
        return self.grpc_threads + (1 + MAX_LAYER_STREAMS) * self.max_drafts

    @property
    def worker_ttl_s(self) -> float:
        """A draft worker that misses three heartbeats is gone."""
        return 3 * self.heartbeat_interval_s
