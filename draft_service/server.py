"""``card-draft``: a draft worker process.

    card-draft --cache HOST:PORT [--model SPEC] [--quantize int8] [--port 50053]

It loads one draft model, registers with the cache service and grows candidate trees for the
sessions the cache assigns to it. Its own gRPC port serves grpc.health.v1 only: SERVING once the
model is loaded and the worker is registered with the cache, NOT_SERVING while it (re)connects.
"""

from __future__ import annotations

import logging
import os

import click
import grpc
import torch

from card_common.channels import warn_if_cleartext
from card_common.cli import exit_on_error, logging_options, option, service_command, tls_options
from card_common.serving import (
    add_health,
    bind,
    make_server,
    serve_until_signal,
    set_serving,
    setup_logging,
    start_health_port,
    start_metrics_server,
)
from card_common.tls import PLAINTEXT, TlsConfig
from draft_service.config import DraftConfig, default_worker_name
from draft_service.link import CacheLink
from engine.config import tree_params
from engine.loading.models import QUANTIZE, ModelConfig, load_model

log = logging.getLogger("draft_service")


def create_server(addr: str, tls: TlsConfig = PLAINTEXT) -> tuple[grpc.Server, int]:
    """A health-only gRPC server bound to ``addr`` ("host:port", port 0 = OS-chosen)."""
    server = make_server(max_workers=4)
    return server, bind(server, addr, tls)


def serve(config: DraftConfig) -> None:
    server, port = create_server(f"{config.host}:{config.port}", config.tls)
    health = add_health(server)
    server.start()
    health_server, _ = start_health_port(health, config.host, config.health_port)
    warn_if_cleartext(config.cache_addr, config.draft_token, config.tls, "draft")
    print(f"card-draft listening on {config.host}:{port}", flush=True)
    start_metrics_server(config.metrics_port, config.metrics_host)
    if config.threads:
        torch.set_num_threads(config.threads)
    log.info("loading draft model %s", config.model.label)
    model = load_model(config.model)
    log.info("loaded %s (tokenizer %s); worker name %s", model.name, model.fingerprint, config.name)
    link = CacheLink(config, model, on_serving=lambda serving: set_serving(health, serving))
    link.start()
    serve_until_signal(server, link.close, grace_s=2.0, health_servicer=health, health_server=health_server)


@service_command("CARD_DRAFT")
@option("--cache", "cache_addr", required=True, help="Address of the cache service, HOST:PORT.")
@option("--model", default="default",
        help="Hugging Face id, local folder, .gguf file, or 'default' (embedded SmolLM2-135M).")
@option("--quantize", type=click.Choice(QUANTIZE), default="none",
        help="int8: dynamic int8 Linear layers (CPU).")
@option("--dtype", default="auto", help="auto, float32, bfloat16, float16.")
@option("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N.")
@option("--name", default=None, help="Worker name targets select it by (default: <model>-<host>-<pid>).")
@option("--capacity", default=8, type=int,
        help="Most concurrent sessions, all grown in one forward per round (KV slots).")
@option("--max-model-len", default=None, type=int,
        help="Committed tokens per session the KV cache holds (default: the context window, at most 4096); "
             "a longer session is not drafted.")
@option("--kv-cache-gb", default=None, type=float,
        help="Memory for keys and values (default: --capacity slots); fewer slots where it holds fewer.")
@option("--tree-width", "-K", default=None, type=int,
        help="K: primary nodes per layer (default: 3 on CPU, 4 on GPU).")
@option("--branch", default=None, type=int,
        help="k: secondary children kept per expanded node (default: 4 on CPU, K on GPU).")
@option("--max-depth", default=None, type=int, help="Layers grown below the root before idling (default 8).")
@option("--threads", default=None, type=int, help="torch threads (default: torch's choice).")
@option("--draft-token", default=None,
        help="Present this token to the cache (authorization: Bearer), where card-cache requires one "
             "(its --draft-token).")
@option("--nice", default=10, type=click.IntRange(0, 19),
        help="Scheduling niceness of this process: a draft that shares cores with a target, its cache or "
             "their clients yields the CPU to them first (0: as they are).")
@option("--host", default="127.0.0.1", help="Interface of the health port (0.0.0.0 in containers).")
@option("--port", default=50053, type=int, help="gRPC health port (0 = OS-chosen).")
@option("--metrics-port", default=9093, type=int, help="Prometheus port (0 = disabled).")
@option("--metrics-host", default="127.0.0.1",
        help="Interface of the metrics port (0.0.0.0 in containers, where Prometheus scrapes the pod).")
@tls_options("card-draft")
@logging_options
def main(cache_addr: str, model: str, quantize: str, dtype: str, device: str, name: str | None,
         capacity: int, max_model_len: int | None, kv_cache_gb: float | None, tree_width: int | None,
         branch: int | None, max_depth: int | None,
         threads: int | None, draft_token: str | None, nice: int, host: str,
         port: int, metrics_port: int, metrics_host: str, tls: TlsConfig, health_port: int | None,
         log_level: str, json_logs: bool) -> None:
    """Run a CARD draft worker for the cache service at --cache."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_logging(log_level, json_logs)
    if nice:
        os.nice(nice)  # every thread of this process, the draft worker's torch threads included
    with exit_on_error("card-draft"):
        config = DraftConfig(
            cache_addr=cache_addr,
            model=ModelConfig(model, dtype, device, quantize),
            name=name or default_worker_name(model, quantize),
            tree=tree_params(device, width=tree_width, branch=branch, max_depth=max_depth),
            capacity=capacity,
            max_model_len=max_model_len,
            kv_cache_gb=kv_cache_gb,
            threads=threads,
            draft_token=draft_token or None,
            tls=tls,
            health_port=health_port,
            host=host,
            port=port,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            log_level=log_level,
            json_logs=json_logs,
        )
        serve(config)


if __name__ == "__main__":
    main()
