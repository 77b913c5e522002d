"""Configuration of the target service, built once from flags and CARD_TARGET_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidArgument
from engine.loading.models import ModelConfig


@dataclass(frozen=True)
class TargetConfig:
    model: ModelConfig
    cache_addr: str | None = None  # None: plain decoding only
    host: str = "127.0.0.1"
    port: int = 50051
    threads: int | None = None
    max_concurrency: int = 4
    default_max_new_tokens: int = 128
    step_timeout_ms: int = 1000
    metrics_port: int = 9091
    log_level: str = "INFO"
    json_logs: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise InvalidArgument(f"max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.default_max_new_tokens < 1:
            raise InvalidArgument(f"default-max-new-tokens must be >= 1, got {self.default_max_new_tokens}")
        if self.step_timeout_ms < 1:
            raise InvalidArgument(f"step-timeout-ms must be >= 1, got {self.step_timeout_ms}")
        if self.threads is not None and self.threads < 1:
            raise InvalidArgument(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise InvalidArgument("ports must be in [0, 65535]")
