"""Configuration of the target service, built once from flags and CARD_TARGET_* variables."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from pathlib import Path

from card.common.drafts import POOL_NAME
from card.common.tls import TlsConfig
from card.engine.loading.models import ModelConfig
from card.engine.shared.config import Verify, VerifyPolicy
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.kv_pool import DEVICE_KV_SHARE, PoolShape, check_sizing, size_pool
from card.engine.shared.static_step import STEP_MODES
from card.engine.target.drafting_policy import DraftingConfig
from card.engine.target.prefill_order import PREFILL_ORDERS

MAX_MODEL_NAME = 256  # characters of a served model name


@dataclass(frozen=True)
class TargetConfig:
    """max_batch_size: most generations in one forward (KV slots, unless kv_cache_gb holds fewer).
    kv_cache_gb: memory for keys and values; None = max_batch_size slots (on an accelerator, within
    a share of its free memory). max_model_len: rows per slot (prompt + new tokens); None = the
    model's context window where the KV budget holds max_batch_size of it (kv_pool.size_pool).
    max_batch_tokens: tokens per forward: decoding rows first (chains cut, longest first, to fit;
        every generation keeps its next token), then prefill chunks while it lasts.
    adaptive_chains: cut chains each iteration to what pays at the measured cost of a row
    (card.engine.target.speculation); off verifies every chain the cache hands out. speculation:
    auto (speculate where it measurably pays, per load and per request), always, or never (every
    draft paused). Whether the forward is batch-invariant (--exact) is ``model.exact``.
    served_model_names: the names requests may give as ``model`` (vLLM's --served-model-name): the
    first is the one reported; none = the --model string. http_port None: no HTTP API; http_host
    None: --host's interface (one --host opens both APIs, as vLLM's does)."""

    model: ModelConfig
    cache_addr: str | None = None  # None: plain decoding only
    default_pool: str = ""  # the draft pool an unnamed request prefers ("" = any)
    # a request's draft session opens once its prompt is prefilled (its first token), not when it
    # takes a KV slot: a draft worker on the target's cores then does not slow the target's prefill
    draft_after_prefill: bool = True
    served_model_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 50051
    threads: int | None = None
    # on a CPU, the forwards drop to fewer threads while other threads hold cores and climb back
    # when they are idle (card.engine.shared.thread_governor); off: always ``threads``
    adaptive_threads: bool = True
    max_batch_size: int = 8
    kv_cache_gb: float | None = None
    # without kv_cache_gb, on an accelerator: the share of the memory free once the model is loaded
    # that keys and values may take (vLLM's --gpu-memory-utilization, which counts the whole card)
    kv_cache_memory_fraction: float = DEVICE_KV_SHARE
    max_model_len: int | None = None
    # a prompt reuses the keys and values of the longest whole-chunk prefix a KV slot still holds
    # (card.engine.shared.prefix_cache; vLLM's --enable-prefix-caching); the outputs are the same bits
    enable_prefix_caching: bool = True
    # finished sequences kept for later prompts beyond the live slots (kv_pool.CACHED_PER_SLOT per
    # slot): on the CPU without kv_cache_gb at most this many GB resident (vLLM's CPU KV space is
    # 4 GB); with a KV budget, as many as it holds; 0: none (the free live slots still cache)
    prefix_cache_gb: float = 4.0
    max_batch_tokens: int = 512
    # beside decoding rows, prefill chunks are paced so that decoding streams' mean time between
    # tokens stays within this multiple of theirs alone (engine.target.scheduler.PrefillPacer); 0: off
    max_decode_slowdown: float = 1.5
    # which waiting prompts an iteration prefills (card.engine.target.prefill_order): shortest
    # first, grouped where the measured cost says it pays; or arrival order
    prefill_order: str = "shortest"
    adaptive_chains: bool = True
    speculation: str = "auto"  # the drafting policy's regime (card.engine.target.drafting_policy)
    decode_step: str = "auto"  # decoding rows at static shapes (card.engine.shared.static_step)
    # the most new tokens one request generates (None: no cap); a request that sets no budget
    # gets the rest of the context, both cut to this
    max_tokens_cap: int | None = None
    chat_template: str | None = None  # a Jinja file or the template itself, over the model's own
    step_timeout_ms: int = 1000
    shutdown_grace_s: float = 30.0  # SIGTERM: how long running generations get to finish
    metrics_port: int = 9091
    metrics_host: str = "127.0.0.1"
    http_port: int | None = 8000  # the OpenAI-compatible HTTP front (vllm serve's port); None: off
    http_host: str | None = None  # None: host
    http_tls_cert: str | None = None  # HTTPS on the HTTP front (with http_tls_key); None: plain HTTP
    http_tls_key: str | None = None
    http_metrics: bool = True  # /metrics on the HTTP front (behind the API key when there is one)
    max_body_mb: float = 4.0  # largest HTTP body or gRPC message; larger ones are refused unread
    max_waiting: int = 64  # requests waiting for a KV slot; more are refused at once
    queue_timeout_s: float = 30.0  # how long a request waits for a KV slot before it is refused
    allow_loose: bool = True  # serve requests that ask for verify loose (lossy, by their choice)
    # verify rejection trusts the draft's claims about q (docs/architecture.md, trust model): off,
    # such requests are verified exactly (lossless whatever the draft); on, within the q floor
    allow_rejection: bool = False
    rejection_q_floor: float = 0.01
    loose_entropy_threshold: float = 0.3  # FLy's gate for loose requests that set none
    loose_window: int = 6  # FLy's deferred window for loose requests that set none
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a log line; both ports
    target_token: str | None = field(default=None, repr=False)  # presented to the cache (a secret)
    tls: TlsConfig = field(default_factory=TlsConfig)  # served on the gRPC port, used to dial the cache
    health_port: int | None = None  # plaintext grpc.health.v1 alone, for probes that cannot speak TLS
    log_level: str = "INFO"
    json_logs: bool = False

    def __post_init__(self) -> None:
        DraftingConfig(speculation=self.speculation)  # validates
        if self.decode_step not in STEP_MODES:
            raise InvalidArgument(f"decode-step must be one of {', '.join(STEP_MODES)}, "
                                  f"got {self.decode_step!r}")
        if self.default_pool and not POOL_NAME.fullmatch(self.default_pool):
            raise InvalidArgument(f"--default-pool must be 1-128 characters of A-Z a-z 0-9 . _ -, got "
                                  f"{self.default_pool[:40]!r}")
        for name in self.served_model_names:
            if not 0 < len(name) <= MAX_MODEL_NAME or any(c.isspace() or c == "," for c in name):
                raise InvalidArgument(f"a served model name is 1-{MAX_MODEL_NAME} characters, no spaces "
                                      f"or commas, got {name[:40]!r}")
        if self.max_batch_size < 1:
            raise InvalidArgument(f"max-batch-size must be >= 1, got {self.max_batch_size}")
        check_sizing(self.kv_cache_gb, self.max_model_len, self.kv_cache_memory_fraction)
        if not self.prefix_cache_gb >= 0:
            raise InvalidArgument(f"prefix-cache-gb must be >= 0, got {self.prefix_cache_gb}")
        VerifyPolicy(Verify.LOOSE, self.loose_entropy_threshold, self.loose_window)  # refused here
        VerifyPolicy(Verify.REJECTION, q_floor=self.rejection_q_floor)  # refused here
        if self.max_batch_tokens < 1:
            raise InvalidArgument(f"max-batch-tokens must be >= 1, got {self.max_batch_tokens}")
        if not (self.max_decode_slowdown == 0 or self.max_decode_slowdown > 1):
            raise InvalidArgument(f"max-decode-slowdown must be > 1, or 0 (off), "
                                  f"got {self.max_decode_slowdown}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise InvalidArgument(f"prefill-order must be one of {', '.join(PREFILL_ORDERS)}, "
                                  f"got {self.prefill_order!r}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise InvalidArgument(f"max-tokens-cap must be >= 1, got {self.max_tokens_cap}")
        _ = self.chat_template_text  # a missing file or a template that does not parse: at start
        if not self.shutdown_grace_s >= 0:
            raise InvalidArgument(f"shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        if self.step_timeout_ms < 1:
            raise InvalidArgument(f"step-timeout-ms must be >= 1, got {self.step_timeout_ms}")
        if self.threads is not None and self.threads < 1:
            raise InvalidArgument(f"threads must be >= 1, got {self.threads}")
        ports = (self.port, self.metrics_port, 0 if self.http_port is None else self.http_port)
        if not all(0 <= p <= 65535 for p in ports):
            raise InvalidArgument("ports must be in [0, 65535]")
        if self.max_waiting < 0:
            raise InvalidArgument(f"max-waiting must be >= 0, got {self.max_waiting}")
        if not self.queue_timeout_s > 0:
            raise InvalidArgument(f"queue-timeout-s must be > 0, got {self.queue_timeout_s}")
        if not self.max_body_mb > 0:
            raise InvalidArgument(f"max-body-mb must be > 0, got {self.max_body_mb}")
        if (self.http_tls_cert is None) != (self.http_tls_key is None):
            raise InvalidArgument("--http-tls-cert and --http-tls-key go together (a certificate and its "
                                  "private key)")
        self.http_tls.check_files()  # fail at start, with the path

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request may give as ``model``; the first is reported (responses, /v1/models,
        Info, metrics): card-target names its loaded model so."""
        return self.served_model_names or (self.model.label,)

    def accepted_names(self, reported: str) -> tuple[str, ...]:
        """The names a request may give, the loaded model's (``reported``, the first served name)
        first: one list for the check and for /v1/models."""
        return tuple(dict.fromkeys((reported, *self.served_model_names)))

    @property
    def http_interface(self) -> str:
        return self.host if self.http_host is None else self.http_host

    @property
    def chat_template_text(self) -> str | None:
        """The --chat-template: a file's text, or the value itself where it is a template (holds
        ``{{`` or ``{%``, as vLLM reads its flag); InvalidArgument for neither, or bad Jinja."""
        value = self.chat_template
        if not value:
            return None
        try:
            is_file = Path(value).expanduser().is_file()
        except OSError:  # an inline template longer than a file name may be
            is_file = False
        if is_file:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        elif "{{" in value or "{%" in value:
            # one line on a command line: its escapes (\n) read as vLLM reads them
            text = codecs.decode(value, "unicode_escape") if value.isascii() else value
        else:
            raise InvalidArgument(f"--chat-template {value[:80]!r} is neither a file nor a Jinja template")
        from jinja2 import Environment, TemplateSyntaxError

        try:
            Environment().parse(text)
        except TemplateSyntaxError as err:
            raise InvalidArgument(f"--chat-template does not parse as Jinja: {err}") from None
        return text

    @property
    def http_tls(self) -> TlsConfig:
        """What the HTTP front serves (a certificate and key; no client certificates)."""
        return TlsConfig(cert=self.http_tls_cert, key=self.http_tls_key)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @classmethod
    def from_options(cls, *, model: str, dtype: str, device: str, exact: bool, cache_addr: str | None,
                     cpu_linear: str = "auto", cpu_attention: str = "auto",
                     api_key: str | None, target_token: str | None, http_tls_cert: str | None = None,
                     http_tls_key: str | None = None, http: bool = True, http_port: int | None = 8000,
                     http_host: str | None = None, served_model_name: tuple[str, ...] = (),
                     **options: object) -> TargetConfig:
        """The config of card-target's flags (one keyword per flag; every other flag is a field).
        ``served_model_name``: each value one name or several, comma-separated (the flag repeats)."""
        names = tuple(n.strip() for value in served_model_name for n in value.split(","))
        model_config = ModelConfig(model, dtype, device, exact=exact, cpu_linear=cpu_linear,
                                   cpu_attention=cpu_attention)
        return cls(model=model_config, cache_addr=cache_addr or None,
                   api_key=api_key or None, target_token=target_token or None,
                   http_tls_cert=http_tls_cert or None, http_tls_key=http_tls_key or None,
                   http_port=http_port if http else None, http_host=http_host or None,
                   served_model_names=tuple(dict.fromkeys(names)), **options)  # type: ignore[arg-type]

    def kv_sizing(self, context_window: int, bytes_per_token: int,
                  free_bytes: int | None = None) -> PoolShape:
        """Slots and rows per slot of the KV cache for a model with this context window and keys +
        values of ``bytes_per_token`` bytes per token; ``free_bytes``: the accelerator's free
        memory (kv_pool.device_free_bytes), None on the CPU."""
        return size_pool(self.max_batch_size, self.max_model_len, context_window, bytes_per_token,
                         self.kv_cache_gb, free_bytes=free_bytes,
                         memory_fraction=self.kv_cache_memory_fraction,
                         prefix_cache_gb=self.prefix_cache_gb if self.enable_prefix_caching else None)

    def kv_shape(self, context_window: int, bytes_per_token: int) -> tuple[int, int]:
        shape = self.kv_sizing(context_window, bytes_per_token)
        return shape.slots, shape.max_len
