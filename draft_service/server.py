"""``card-draft``: a draft worker process.

    card-draft --cache HOST:PORT [--model SPEC] [--quantize int8] [--cascade ngram] [--port 50053]
    card-draft --cache HOST:PORT --model ngram --tokenizer TARGET_SPEC      (model-free)

It loads one draft model (or, model-free, the target's tokenizer alone), registers with the cache
service and grows candidate trees for the sessions the cache assigns to it. Its own gRPC port
serves grpc.health.v1 only: SERVING once the model is loaded and the worker is registered with the
cache with both of its streams (Commands, PublishLayers) open and heartbeats answered; NOT_SERVING
from the moment the link breaks until it has registered again (card.draft_service.link).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import click
import torch

from card.common.channels import warn_if_cleartext
from card.common.cli import (
    DRAFT_SHAPE,
    cpu_linear_option,
    exit_on_error,
    logging_options,
    ngram_options,
    option,
    service_command,
    tls_options,
    tree_options,
)
from card.common.health import Health, HealthPort
from card.common.niceness import lower_priority
from card.common.serving import (
    serve_until_signal,
    set_serving,
    setup_logging,
    start_health_port,
    start_metrics_server,
)
from card.common.tls import PLAINTEXT, TlsConfig
from card.draft_service.config import NGRAM_CAPACITY, NGRAM_MAX_MODEL_LEN, DraftConfig
from card.draft_service.link import CacheLink
from card.engine.draft.drafter import tree_rows
from card.engine.draft.static_tree import DRAFT_STEP_MODES
from card.engine.draft.worker import DraftWorker, Publish
from card.engine.loading.fingerprint import tokenizer_fingerprint
from card.engine.loading.models import QUANTIZE, load_model, load_tokenizer
from card.engine.shared.config import NGRAM
from card.engine.shared.kv_pool import DEVICE_KV_SHARE, KVPool, device_free_bytes
from card.engine.shared.ngram_stats import shared_table
from card.engine.shared.torch_threads import on_passing_thread

log = logging.getLogger("draft_service")


def create_server(host: str, port: int, tls: TlsConfig = PLAINTEXT) -> tuple[HealthPort, Health]:
    """The draft's gRPC port: grpc.health.v1 alone, on ``host:port`` (port 0 = OS-chosen; the
    bound one is ``.port``), started, everything NOT_SERVING; no caller can hold it
    (card.common.health)."""
    health = Health()
    return HealthPort(health, host, port, tls), health


def serve(config: DraftConfig) -> None:
    server, health = create_server(config.host, config.port, config.tls)
    port = server.port
    health_server, _ = start_health_port(health, config.host, config.health_port)
    warn_if_cleartext(config.cache_addr, config.draft_token, config.tls, "draft")
    print(f"card-draft listening on {config.host}:{port}", flush=True)
    start_metrics_server(config.metrics_port, config.metrics_host)
    threads = config.threads or torch.get_num_threads()  # the draft forwards'; the main thread's default
    # this long-lived thread never runs torch in parallel: an OpenMP pool of its own would slow
    # the worker thread's forwards (card.engine.shared.torch_threads)
    link = CacheLink(config, lambda *callbacks: on_passing_thread(lambda: build_worker(config, *callbacks),
                                                                  threads, name="load-draft"),
                     on_serving=lambda serving: set_serving(health, serving))
    link.start()
    def shut_down() -> None:  # drain first: its sessions move to other workers, none is lost
        link.drain(config.drain_timeout_s)
        link.close()

    serve_until_signal(server, shut_down, grace_s=2.0, health_servicer=health, health_server=health_server)


def build_worker(config: DraftConfig, publish: Publish, on_forward: Callable[[int], None],
                 on_drop: Callable[[str], None]) -> tuple[DraftWorker, str]:
    """The worker ``config`` asks for (its kind: neural, cascade or model-free) and the
    fingerprint of the tokenizer it drafts for; its callbacks are the CacheLink's."""
    callbacks = {"on_forward": on_forward, "on_drop": on_drop, "name": config.name}
    if config.model_free:
        assert config.tokenizer is not None and config.ngram is not None
        log.info("model-free draft for the tokenizer of %s", config.tokenizer)
        tokenizer = load_tokenizer(config.tokenizer)
        vocab = len(tokenizer)
        table = shared_table(vocab, config.ngram, lambda text: tokenizer(text)["input_ids"])
        if table is not None:
            log.info("shared n-gram table: %d n-grams from the corpus, %.1f MB budget", len(table),
                     config.ngram.table_mb)
        worker = DraftWorker.of_kind(config.drafter, None, config.tree, publish, slots=config.capacity,
                                     max_len=config.max_model_len or NGRAM_MAX_MODEL_LEN,
                                     ngram_config=config.ngram, ngram=table, vocab_size=vocab, **callbacks)
        return worker, tokenizer_fingerprint(tokenizer)
    log.info("loading draft model %s", config.model.label)
    model = load_model(config.model)
    log.info("loaded %s (tokenizer %s); worker name %s", model.name, model.fingerprint, config.name)
    shape = config.kv_sizing(model.context_window, KVPool.bytes_per_token(model.model),
                             device_free_bytes(next(model.model.parameters()).device))
    slots, max_len = shape.slots, shape.max_len
    table = None
    if config.drafter.uses_ngram:
        assert config.ngram is not None
        encode = lambda text: model.tokenizer(text)["input_ids"]  # noqa: E731
        table = shared_table(len(model.tokenizer), config.ngram, encode)
    worker = DraftWorker.of_kind(config.drafter, model.model, config.tree, publish, slots=slots,
                                 max_len=max_len, cached_slots=shape.cached_slots,
                                 cache_bytes=shape.cache_bytes, threads=config.threads,
                                 ngram_config=config.ngram, ngram=table, decode_step=config.decode_step,
                                 **callbacks)
    assert worker.pool is not None
    log.info("draft %s; each slot also holds %d tree rows", shape.describe(worker.pool.nbytes),
             tree_rows(config.tree))
    return worker, model.fingerprint


@service_command("CARD_DRAFT")
@option("--cache", "cache_addr", required=True, help="Address of the cache service, HOST:PORT.")
@option("--model", default="default",
        help="Hugging Face id, local folder, .gguf file, 'default' (embedded SmolLM2-135M), or 'ngram': "
             "model-free drafting from n-gram statistics (no model, no accelerator; give --tokenizer).")
@option("--tokenizer", default=None,
        help="--model ngram: the target's model spec or tokenizer folder (its tokenizer is the one "
             "drafted for; the cache checks its fingerprint like any draft's).")
@option("--cascade", type=click.Choice(["none", NGRAM]), default="none",
        help="ngram: n-gram statistics beneath the draft model; each forward also checks their "
             "likeliest continuations, growing the tree deeper where they are right.")
@option("--quantize", type=click.Choice(QUANTIZE), default="none",
        help="int8: dynamic int8 Linear layers (CPU).")
@option("--dtype", default="auto", help="auto, float32, bfloat16, float16.")
@option("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N.")
@cpu_linear_option()
@option("--name", default=None,
        help="Unique worker name, shown in card-client drafts (default: <pool>-<host>-<pid>).")
@option("--pool", default=None,
        help="The draft pool this worker serves in; requests name pools (--draft POOL), so the pool's "
             "workers can be scaled, drained and replaced under one name (default: the model and "
             "quantization, e.g. qwen2.5-coder-0.5b-int8).")
@option("--drain-timeout-s", default=20.0, type=float,
        help="On SIGTERM: stop taking sessions and hand the live ones to other workers for at most this "
             "long, then exit (keep it below the pod's termination grace period).")
@option("--capacity", default=None, type=int,
        help=f"Most concurrent sessions, all grown in one forward per round (KV slots). Default: 8; "
             f"{NGRAM_CAPACITY} model-free.")
@option("--max-model-len", default=None, type=int,
        help=f"Committed tokens per session the KV cache holds (default: the context window where the KV "
             f"budget holds --capacity sessions of it, as card-target's; model-free {NGRAM_MAX_MODEL_LEN}); "
             f"a longer session is not drafted.")
@option("--kv-cache-gb", default=None, type=float,
        help="Memory for keys and values (default: --capacity slots; on a GPU within "
             "--kv-cache-memory-fraction of the memory free once the model is loaded); fewer slots "
             "where it holds fewer.")
@option("--kv-cache-memory-fraction", default=DEVICE_KV_SHARE, type=float,
        help="Without --kv-cache-gb, on a GPU: the share of the memory free once the model is loaded "
             "that keys and values may take, in (0, 1].")
@option("--prefix-cache-gb", default=2.0, type=float, show_default=True,
        help="Finished sessions' text stays cached beyond the --capacity slots for a conversation's "
             "next turn (4 more slots per slot): on the CPU without --kv-cache-gb at most this many "
             "GB resident (the least recently used go first); with a KV budget, as many as it holds. "
             "0: only free slots keep theirs.")
@tree_options(DRAFT_SHAPE, note="The draft worker owns its tree's shape.")
@option("--threads", default=None, type=int, help="torch threads (default: torch's choice).")
@option("--decode-step", type=click.Choice(DRAFT_STEP_MODES), default="auto", show_default=True,
        help="How the tree rows of a round run: eager (the flat eager forward); static (every "
             "session's tree rows in one batch padded to a bucket, from preallocated buffers, the "
             "eager forward's bits); graphs (CUDA graphs of it, CUDA only); auto: graphs on CUDA, "
             "eager on the CPU (docs/engine.md). Prefill chunks run eager.")
@option("--draft-token", default=None,
        help="Present this token to the cache (authorization: Bearer), where card-cache requires one "
             "(its --draft-token).")
@option("--pool-token", default=None,
        help="Present this token for --pool at registration, where card-cache binds pools to tokens "
             "(its --pool-tokens).")
@option("--nice", default=10, type=click.IntRange(0, 19),
        help="Scheduling niceness of this process (and of its session's scheduling group where it leads "
             "its session, as card-client up starts it: Linux's autogroups would otherwise rank it only "
             "against itself): a draft that shares cores with a target, its cache or their clients "
             "yields the CPU to them first (0: as they are).")
@option("--host", default="127.0.0.1", help="Interface of the health port (0.0.0.0 in containers).")
@option("--port", default=50053, type=int, help="gRPC health port (0 = OS-chosen).")
@option("--metrics-port", default=9093, type=int, help="Prometheus port (0 = disabled).")
@option("--metrics-host", default="127.0.0.1",
        help="Interface of the metrics port (0.0.0.0 in containers, where Prometheus scrapes the pod).")
@ngram_options("card-draft")
@tls_options("card-draft")
@logging_options
def main(nice: int, **options: object) -> None:
    """Run a CARD draft worker for the cache service at --cache."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_logging(options["log_level"], options["json_logs"])  # type: ignore[arg-type]
    if nice:
        lowered = lower_priority(nice)  # the draft worker's torch threads included
        log.info("niceness %d for the %s", os.getpriority(os.PRIO_PROCESS, 0), lowered)
    with exit_on_error("card-draft"):
        config = DraftConfig.from_options(**options)  # type: ignore[arg-type]
        serve(config)

if __name__ == "__main__":
    main()
