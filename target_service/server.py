"""``card-target``: the user-facing service; runs the target model and streams exact output.

    card-target [--model SPEC] [--cache HOST:PORT]   # OpenAI API on :8000 (as vllm serve), gRPC on :50051

Health: SERVING as soon as the model is loaded. A configured cache that is unreachable does not
make the target NOT_SERVING: the target still answers every request exactly, by plain decoding,
and speculates again as soon as the cache answers (each request tries to open a session). Taking
the target out of rotation while the cache restarts would turn a slowdown into an outage.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import click
import grpc
import torch

from card.common.auth import TARGET_ROLES, TokenAuth
from card.common.channels import LOOPBACK, channel, wait_serving, warn_if_cleartext
from card.common.cli import (
    cpu_attention_option,
    cpu_linear_option,
    exact_option,
    exit_on_error,
    logging_options,
    option,
    service_command,
    tls_options,
)
from card.common.serving import (
    add_health,
    bind,
    make_server,
    serve_until_signal,
    set_serving,
    setup_logging,
    start_health_port,
    start_metrics_server,
)
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.loading.models import LoadedModel, load_model
from card.engine.shared.errors import Unavailable
from card.engine.shared.kv_pool import DEVICE_KV_SHARE, KVPool, device_free_bytes
from card.engine.shared.static_step import STEP_MODES
from card.engine.shared.torch_threads import on_passing_thread
from card.engine.target.drafting_policy import SPECULATION_MODES
from card.engine.target.prefill_order import PREFILL_ORDERS
from card.engine.target.scheduler import TargetEngine
from card.target_service.config import TargetConfig
from card.target_service.engine_loop import EngineLoop, drafting_policy
from card.target_service.frontend import Frontend
from card.target_service.openai_api import DEFAULT_MAX_BODY_BYTES, HttpServer, create_app
from card.target_service.servicer import TargetServicer
from card.v1 import cache_pb2_grpc, target_pb2_grpc

log = logging.getLogger("target_service")

SERVICE_NAME = "card.v1.TargetService"


API_KEY_HINT = "the API key (authorization: Bearer KEY; card-client --api-key / CARD_CLIENT_API_KEY)"


# Threads of the gRPC front beyond its generations' (Info, health-free: card.common.gate runs
# health on threads of its own): a call past the front's bound still finds one to be refused on.
RESERVE_THREADS = 16


def grpc_threads(config: TargetConfig) -> int:
    """Every streaming Generate holds a thread, running or waiting for a KV slot: the most that
    can (--max-batch-size + --max-waiting), and the reserve. No more calls than this are taken at
    once: the next one is refused RESOURCE_EXHAUSTED at once, as the engine refuses past
    --max-waiting, instead of queueing for a thread with no bound."""
    return config.max_batch_size + config.max_waiting + RESERVE_THREADS


def create_server(addr: str, max_workers: int = 16, tls: TlsConfig = PLAINTEXT,
                  api_key: str | None = None, max_receive_bytes: int = DEFAULT_MAX_BODY_BYTES
                  ) -> tuple[grpc.Server, int]:
    """A gRPC server bound to ``addr`` ("host:port", port 0 = OS-chosen); not started; at most
    ``max_workers`` calls in flight, messages of at most ``max_receive_bytes``. With ``api_key``,
    Generate and Info answer UNAUTHENTICATED to a call without it, before its message is read
    (health stays open)."""
    auth = TokenAuth(TARGET_ROLES, {"user": api_key}, hints={"user": API_KEY_HINT})
    server = make_server(max_workers=max_workers, interceptors=[auth], maximum_concurrent_rpcs=max_workers,
                         max_receive_bytes=max_receive_bytes)
    return server, bind(server, addr, tls)


def api_url(config: TargetConfig, port: int) -> str:
    """The OpenAI base URL of the HTTP front (what a client's base_url is set to)."""
    host = config.http_interface
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return f"{'https' if config.http_tls.serves else 'http'}://{host}:{port}/v1"


def warn_if_open(config: TargetConfig) -> None:
    """One warning at start for each port that serves without a key (on loopback too: every
    local user reaches it), or whose key and prompts would cross the network in clear."""
    ports = [("gRPC", config.host, config.tls.serves, "--tls-cert")]
    if config.http_port is not None:
        ports.append(("HTTP", config.http_interface, config.http_tls.serves, "--http-tls-cert"))
    for what, host, tls, flag in ports:
        if not config.api_key:
            log.warning("the %s API listens on %s without --api-key: anyone who reaches it can generate "
                        "(set --api-key / CARD_TARGET_API_KEY)", what, host)
        elif host in LOOPBACK:
            continue
        elif not tls:
            log.warning("the %s API listens on %s without TLS: the API key and prompts cross the network "
                        "in clear (%s)", what, host, flag)


def load_engine(config: TargetConfig) -> tuple[LoadedModel, TargetEngine]:
    """The target model, named as served (``TargetConfig.served_names``), and the engine over its
    KV cache (on the thread whose torch threads the probes of an exact forward check)."""
    log.info("loading target model %s", config.model.label)
    model = load_model(config.model)
    log.info("loaded %s (tokenizer %s, context window %d, exact forward %s)", model.name, model.fingerprint,
             model.context_window, "on" if model.exact else "off: outputs may change with the load")
    model = dataclasses.replace(model, name=config.served_names[0])
    device = next(model.model.parameters()).device
    shape = config.kv_sizing(model.context_window, KVPool.bytes_per_token(model.model),
                             device_free_bytes(device))
    pool = KVPool(model.model, shape.slots, shape.max_len, prefix_caching=config.enable_prefix_caching,
                  cached_slots=shape.cached_slots, cache_bytes=shape.cache_bytes)
    log.info("%s; prefix caching %s", shape.describe(pool.nbytes),
             "on" if config.enable_prefix_caching else "off (--enable-prefix-caching turns it on)")
    engine = TargetEngine(model.model, pool, config.max_batch_tokens, adaptive=config.adaptive_chains,
                          exact=model.exact, policy=drafting_policy(config.speculation),
                          decode_step=config.decode_step, max_decode_slowdown=config.max_decode_slowdown,
                          prefill_order=config.prefill_order)
    return model, engine


def serve(config: TargetConfig) -> None:
    server, port = create_server(f"{config.host}:{config.port}", max_workers=grpc_threads(config),
                                 tls=config.tls, api_key=config.api_key,
                                 max_receive_bytes=config.max_body_bytes)
    warn_if_open(config)
    health = add_health(server)
    cache_channel = None
    stub = None
    if config.cache_addr:
        warn_if_cleartext(config.cache_addr, config.target_token, config.tls, "target")
        cache_channel = channel(config.cache_addr, config.target_token, config.tls)
        stub = cache_pb2_grpc.CacheServiceStub(cache_channel)
    front = Frontend(config, stub)
    target_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(front), server)
    server.start()
    health_server, _ = start_health_port(health, config.host, config.health_port)
    log.info("gRPC on %s:%d (%s)", config.host, port, config.tls.describe())
    print(f"card-target listening on {config.host}:{port}", flush=True)
    http = None
    if config.http_port is not None:
        app = create_app(front, config.api_key, max_body_bytes=config.max_body_bytes,
                         serve_metrics=config.http_metrics)
        http = HttpServer(app, config.http_interface, config.http_port, config.shutdown_grace_s,
                          tls=config.http_tls)
        http.start()  # /health answers 503 while the model loads
        log.info("HTTP on %s:%d (%s)", config.http_interface, http.port,
                 "TLS" if config.http_tls.serves else "plaintext")
        print(f"card-target http listening on {config.http_interface}:{http.port}", flush=True)
    start_metrics_server(config.metrics_port, config.metrics_host)
    threads = config.threads or torch.get_num_threads()  # the forwards' count; the main thread's default
    # this long-lived thread never runs torch in parallel: an OpenMP pool of its own would slow
    # the engine thread's forwards (card.engine.shared.torch_threads)
    model, engine = on_passing_thread(lambda: load_engine(config), threads, name="load-target")
    if config.cache_addr:
        try:
            wait_serving(config.cache_addr, timeout_s=5.0, tls=config.tls)
        except Unavailable as exc:
            log.warning("%s; serving plain decoding until it answers", exc)
    else:
        log.warning("no cache service configured (--cache / CARD_TARGET_CACHE_ADDR): plain decoding only")

    def engine_died(exc: BaseException) -> None:
        set_serving(health, False, [SERVICE_NAME])

    # model_name: the name /v1/models reports, the metrics' model_name
    loop = EngineLoop(engine, threads=threads, max_waiting=config.max_waiting, on_death=engine_died,
                      model_name=model.name, adaptive_threads=config.adaptive_threads)
    loop.start()
    front.ready(model, loop)
    set_serving(health, True, [SERVICE_NAME])
    log.info("serving %s", model.name)
    if http is not None:  # the line a user copies into a client: ready, with the name to send
        print(f"card-target: OpenAI API on {api_url(config, http.port)} (model {model.name})", flush=True)

    def shutdown() -> None:
        # Both fronts stop taking requests at once; running generations get the grace to finish
        # (gRPC and HTTP drain side by side), then whatever is left is cancelled by the engine
        # loop, which closes its cache sessions while the cache channel is still open.
        grace = config.shutdown_grace_s
        front.draining = True
        stopped = server.stop(grace)
        if http is not None:
            http.stop(grace + 1)
        stopped.wait(grace + 1)
        loop.stop()
        if front.link is not None:
            front.link.stop()
            front.link.drain(2.0)  # the last CloseSessions reach the cache before its channel closes
        if cache_channel is not None:
            cache_channel.close()

    serve_until_signal(server, shutdown, grace_s=config.shutdown_grace_s, health_servicer=health,
                       health_server=health_server)


@service_command("CARD_TARGET")
@option("--model", default="default",
        help="Hugging Face id, local folder, .gguf file, or 'default' (embedded SmolLM2-135M).")
@option("--served-model-name", multiple=True,
        help="The name clients send as 'model' (default: the --model string). Several: repeat the flag "
             "or separate them by commas; requests may name any, and the first is the one reported "
             "(responses, /v1/models, metrics).")
@option("--cache", "cache_addr", default=None, help="Cache service HOST:PORT (unset: plain decoding only).")
@option("--default-pool", default="",
        help="The draft pool a request that names none prefers while the pool has a live worker (else "
             "any pool whose tokenizer matches, split by the cache's --pool-weights).")
@option("--draft-after-prefill/--no-draft-after-prefill", default=True,
        help="Open a request's draft session once its prompt is prefilled (its first token), not when "
             "it takes a KV slot: a draft worker on the target's cores (card-client up, one machine) "
             "then does not slow the target's prefill and first token. --no-draft-after-prefill "
             "overlaps the two prefills, where draft workers have cores or devices of their own (the "
             "drafts then start sooner).")
@option("--dtype", default="auto", help="auto, float32, bfloat16, float16.")
@option("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N.")
@exact_option()
@cpu_linear_option()
@cpu_attention_option()
@option("--threads", default=None, type=int,
        help="torch threads of the forwards, the most with --adaptive-threads (default: torch's choice, "
             "every core).")
@option("--adaptive-threads/--no-adaptive-threads", default=True,
        help="On a CPU, run a forward on fewer threads while other threads (a draft worker, a load "
             "generator) hold cores, and on all --threads again when they idle: a spinning OpenMP team "
             "beside a busy thread runs many times slower than one thread. The outputs are the same "
             "bits whatever the count (docs/engine.md, Threads).")
@option("--max-batch-size", default=8, type=int,
        help="Most generations in one forward (KV slots); more wait for a slot until their deadline.")
@option("--kv-cache-gb", default=None, type=float,
        help="Memory for keys and values; slots = this / (KV bytes per token x --max-model-len), at "
             "most --max-batch-size (default: --max-batch-size slots; on a GPU within "
             "--kv-cache-memory-fraction of the memory free once the model is loaded).")
@option("--kv-cache-memory-fraction", default=DEVICE_KV_SHARE, type=float,
        help="Without --kv-cache-gb, on a GPU: the share of the memory free once the model is loaded "
             "that keys and values may take, in (0, 1] (vLLM's --gpu-memory-utilization counts the "
             "whole card; here the weights are already loaded).")
@option("--max-model-len", default=None, type=int,
        help="Tokens per request, prompt + new tokens (default: the model's context window where the "
             "KV budget holds --max-batch-size of it, else the longest length it does, at least 4096; "
             "the start-up log says which and why).")
@option("--enable-prefix-caching/--no-enable-prefix-caching", default=True,
        help="Reuse the keys and values of a prompt's longest cached prefix of whole 16-token blocks "
             "(a chat's earlier turns and answers, a shared document or system prompt) instead of "
             "prefilling it again; the outputs are the same bits as with it off (docs/engine.md, "
             "prefix caching).")
@option("--prefix-cache-gb", default=4.0, type=float, show_default=True,
        help="With prefix caching, finished sequences stay cached beyond the --max-batch-size slots "
             "(4 more slots per slot): on the CPU without --kv-cache-gb they keep at most this many GB "
             "resident (the least recently used go first); with a KV budget, as many as it holds. "
             "0: only free slots keep their sequences.")
@option("--max-batch-tokens", default=512, type=int,
        help="Tokens per forward: decoding rows count (the longest chains are cut to fit; every request "
             "keeps its next token), and prefill chunks past it go in the next one.")
@option("--max-decode-slowdown", default=1.5, type=float, show_default=True,
        help="While requests decode, the chunks of prompts longer than one chunk (256 tokens after "
             "their cached prefix) are paced so that the decoding requests' mean time between tokens "
             "stays within this multiple of theirs alone (the median stays theirs alone); prompts get "
             "the rest of the time, all of it when nothing decodes. 0: off, every chunk "
             "--max-batch-tokens holds goes at once. Outputs do not change (docs/engine.md).")
@option("--prefill-order", type=click.Choice(PREFILL_ORDERS), default="shortest", show_default=True,
        help="Which waiting prompts an iteration prefills: shortest (the prompts with the fewest tokens "
             "left first, together only where the measured cost of one more forward says it pays: "
             "in a burst the short prompts' first tokens come while the long ones prefill; a prompt "
             "passed over 8 iterations goes first) or arrival (first come first served, as many as "
             "--max-batch-tokens holds, as vLLM). Outputs do not change (docs/engine.md).")
@option("--adaptive-chains/--no-adaptive-chains", default=True,
        help="Cut each iteration's chains to what pays at the measured cost of a verified row and "
             "each request's acceptance; off: verify every chain the cache hands out.")
@option("--speculation", type=click.Choice(SPECULATION_MODES), default="auto", show_default=True,
        help="auto: speculate only while it measurably pays: the engine compares its committed tokens "
             "per second with and without drafting at the load it has (short probes) and pauses every "
             "draft where plain decoding is faster, and pauses a request's own draft while its chains "
             "are rejected; always: speculate throughout; never: plain decoding, every draft paused.")
@option("--decode-step", type=click.Choice(STEP_MODES), default="auto", show_default=True,
        help="How decoding rows run: eager (the flat eager forward); static (every step's rows in one "
             "batch padded to a bucket, from preallocated buffers); compiled (that step through "
             "torch.compile, one graph per bucket and key span, each compiled at start-up or on first "
             "use: minutes a graph on a small CPU); graphs (CUDA graphs of it, CUDA only); auto: graphs "
             "on CUDA, eager on the CPU. A static step is probed for bitwise invariance at start-up "
             "and falls back to eager where the probe fails (docs/engine.md).")
@option("--max-tokens-cap", default=None, type=int,
        help="The most new tokens one request generates (default: no cap). A request that sets no "
             "max_tokens gets the rest of the context (--max-model-len minus its prompt), as with vLLM; "
             "both are cut to this.")
@option("--chat-template", default=None,
        help="A Jinja chat template (a file, or the template itself on one line) used instead of the "
             "model's own, as vLLM's --chat-template.")
@option("--step-timeout-ms", default=1000, type=int, help="Deadline of each Step call to the cache.")
@option("--shutdown-grace-s", default=30.0, type=float,
        help="On SIGTERM, running generations get this long to finish (keep it below the pod's "
             "terminationGracePeriodSeconds); the rest are ended and their cache sessions closed.")
@option("--host", default="127.0.0.1",
        help="Interface of both APIs: loopback by default (local clients only; vllm serve opens every "
             "interface); 0.0.0.0 in containers or to serve other machines, with --api-key.")
@option("--port", default=50051, type=int, help="gRPC port (0 = OS-chosen).")
@option("--metrics-port", default=9091, type=int, help="Prometheus port (0 = disabled).")
@option("--metrics-host", default="127.0.0.1",
        help="Interface of the metrics port (0.0.0.0 in containers, where Prometheus scrapes the pod).")
@option("--http/--no-http", default=True,
        help="Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
             "/health, /metrics); --no-http: gRPC alone, the --http-* flags unused.")
@option("--http-port", default=8000, type=int, help="Port of the HTTP API (vllm serve's; 0 = OS-chosen).")
@option("--http-host", default=None, help="Interface of the HTTP API, where it differs from --host.")
@option("--http-tls-cert", type=click.Path(dir_okay=False), default=None,
        help="PEM certificate chain the HTTP API serves (HTTPS; re-read when renewed). Default: plain "
             "HTTP.")
@option("--http-tls-key", type=click.Path(dir_okay=False), default=None, help="PEM private key of "
        "--http-tls-cert.")
@option("--http-metrics/--no-http-metrics", default=True,
        help="Also serve /metrics on the HTTP API (behind --api-key when one is set); the metrics port "
             "serves them either way.")
@option("--max-body-mb", default=4.0, type=float,
        help="Largest request: an HTTP body (a larger one is refused with 413 before it is read) or a gRPC "
             "message (RESOURCE_EXHAUSTED).")
@option("--max-waiting", default=64, type=int,
        help="Most requests waiting for a KV slot; more are refused at once (RESOURCE_EXHAUSTED / 429).")
@option("--queue-timeout-s", default=30.0, type=float,
        help="How long a request waits for a KV slot before it is refused (RESOURCE_EXHAUSTED / HTTP 429 "
             "with Retry-After); a gRPC deadline shorter than this wins.")
@option("--allow-loose/--no-allow-loose", default=True,
        help="Serve requests that ask for verify loose (FLy: lossy by the request's choice; its answer "
             "says so). Off: they are refused (INVALID_ARGUMENT / 400). Requests are exact unless they ask.")
@option("--allow-rejection/--no-allow-rejection", default=False,
        help="Serve verify rejection (speculative sampling) as asked; it trusts the draft's claimed "
             "distributions, so a lying draft can skew sampled output, by at most a factor 1 + 2 / "
             "--rejection-q-floor per token (docs/architecture.md). Off: such requests are verified "
             "exactly (lossless whatever the draft; their stats say verify exact).")
@option("--rejection-q-floor", default=0.01, type=float,
        help="verify rejection: a drafted token whose claimed probability is below this is never kept "
             "(the rule is rescaled to stay lossless); it bounds what a lying draft can do.")
@option("--loose-entropy-threshold", default=0.3, type=float,
        help="verify loose: the target's top-3 entropy (nats) at or above which a drafted token it would "
             "not have chosen may be kept, for requests that set none (FLy's 0.3).")
@option("--loose-window", default=6, type=int,
        help="verify loose: a kept mismatch and the drafted tokens after it that the target must agree "
             "with, for requests that set none (FLy's 6). Chains no longer than this are judged exactly.")
@option("--target-token", default=None,
        help="Present this token to the cache (authorization: Bearer), where card-cache requires one "
             "(its --target-token).")
@option("--api-key", default=None,
        help="Require this key on both APIs: 'Authorization: Bearer <key>' on every HTTP path but /health "
             "(401 otherwise, checked before the body is read), and the same as 'authorization: Bearer "
             "<key>' metadata on gRPC Generate and Info (UNAUTHENTICATED otherwise; health stays open).")
@tls_options("card-target")
@logging_options
def main(**options: object) -> None:
    """Run the CARD target service."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_logging(options["log_level"], options["json_logs"])  # type: ignore[arg-type]
    with exit_on_error("card-target"):
        config = TargetConfig.from_options(**options)  # type: ignore[arg-type]
        serve(config)

if __name__ == "__main__":
    main()
