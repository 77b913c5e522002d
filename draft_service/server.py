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

from card_common.serving import (
    add_health,
    bind,
    exit_on_startup_error,
    make_server,
    serve_until_signal,
    set_serving,
    setup_logging,
    start_metrics_server,
)
from draft_service.config import DraftConfig, default_worker_name
from draft_service.link import CacheLink
from engine.config import TreeParams, default_tree_params
from engine.models import QUANTIZE, ModelConfig, load_model, resolve_device

log = logging.getLogger("draft_service")


def create_server(addr: str) -> tuple[grpc.Server, int]:
    """A health-only gRPC server bound to ``addr`` ("host:port", port 0 = OS-chosen)."""
    server = make_server(max_workers=4)
    return server, bind(server, addr)


def serve(config: DraftConfig) -> None:
    server, port = create_server(f"{config.host}:{config.port}")
    health = add_health(server)
    server.start()
    print(f"card-draft listening on {config.host}:{port}", flush=True)
    start_metrics_server(config.metrics_port)
    if config.threads:
        torch.set_num_threads(config.threads)
    log.info("loading draft model %s", config.model.label)
    model = load_model(config.model)
    log.info("loaded %s (tokenizer %s); worker name %s", model.name, model.fingerprint, config.name)
    link = CacheLink(config, model, on_serving=lambda serving: set_serving(health, serving))
    link.start()
    serve_until_signal(server, link.close, grace_s=2.0, health_servicer=health)


def _tree(device: str, width: int | None, branch: int | None, max_depth: int | None) -> TreeParams:
    """Flags over the hardware default (engine.config.default_tree_params)."""
    base = default_tree_params(resolve_device(device).type)
    depth = base.max_depth if max_depth is None else max_depth
    return TreeParams(width=base.width if width is None else width,
                      branch=base.branch if branch is None else branch, max_depth=depth, max_chain=depth)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--cache", "cache_addr", envvar="CARD_CACHE_ADDR", required=True,
              help="Address of the cache service, HOST:PORT.")
@click.option("--model", default="default", envvar="CARD_DRAFT_MODEL", show_default=True,
              help="Hugging Face id, local folder, .gguf file, or 'default' (embedded SmolLM2-135M).")
@click.option("--quantize", type=click.Choice(QUANTIZE), default="none", envvar="CARD_DRAFT_QUANTIZE",
              show_default=True, help="int8: dynamic int8 Linear layers (CPU).")
@click.option("--dtype", default="auto", envvar="CARD_DRAFT_DTYPE", show_default=True)
@click.option("--device", default="auto", envvar="CARD_DRAFT_DEVICE", show_default=True)
@click.option("--name", default=None, envvar="CARD_DRAFT_NAME",
              help="Worker name targets select it by (default: <model>-<host>-<pid>).")
@click.option("--capacity", default=8, envvar="CARD_DRAFT_CAPACITY", show_default=True, type=int,
              help="Most concurrent sessions.")
@click.option("--tree-width", "-K", default=None, envvar="CARD_DRAFT_TREE_WIDTH", type=int,
              help="K: primary nodes per layer (default: 3 on CPU, 4 on GPU).")
@click.option("--branch", default=None, envvar="CARD_DRAFT_BRANCH", type=int,
              help="k: secondary children kept per expanded node (default: 4 on CPU, K on GPU).")
@click.option("--max-depth", default=None, envvar="CARD_DRAFT_MAX_DEPTH", type=int,
              help="Layers grown below the root before idling (default 8).")
@click.option("--threads", default=None, envvar="CARD_DRAFT_THREADS", type=int,
              help="torch threads (default: torch's choice).")
@click.option("--host", default="127.0.0.1", envvar="CARD_DRAFT_HOST", show_default=True,
              help="Interface of the health port (0.0.0.0 in containers).")
@click.option("--port", default=50053, envvar="CARD_DRAFT_PORT", show_default=True, type=int,
              help="gRPC health port (0 = OS-chosen).")
@click.option("--metrics-port", default=9093, envvar="CARD_DRAFT_METRICS_PORT", show_default=True,
              type=int, help="Prometheus port (0 = disabled).")
@click.option("--log-level", default="INFO", envvar="CARD_LOG_LEVEL", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--json-logs", is_flag=True, envvar="CARD_JSON_LOGS", help="One JSON object per log line.")
def main(cache_addr: str, model: str, quantize: str, dtype: str, device: str, name: str | None,
         capacity: int, tree_width: int | None, branch: int | None, max_depth: int | None,
         threads: int | None, host: str,
         port: int, metrics_port: int, log_level: str, json_logs: bool) -> None:
    """Run a CARD draft worker for the cache service at --cache."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_logging(log_level, json_logs)
    with exit_on_startup_error("card-draft"):
        config = DraftConfig(
            cache_addr=cache_addr,
            model=ModelConfig(model, dtype, device, quantize),
            name=name or default_worker_name(model, quantize),
            tree=_tree(device, tree_width, branch, max_depth),
            capacity=capacity,
            threads=threads,
            host=host,
            port=port,
            metrics_port=metrics_port,
            log_level=log_level,
            json_logs=json_logs,
        )
        serve(config)


if __name__ == "__main__":
    main()
