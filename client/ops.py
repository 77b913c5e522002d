"""Operator commands of ``card-client``: ``up`` (a local trio), ``status``, ``drafts``.

Every flag also reads CARD_CLIENT_<OPTION> (card.common.cli.client_context): addresses from
CARD_CLIENT_TARGET_ADDR / CARD_CLIENT_CACHE_ADDR / CARD_CLIENT_DRAFT_ADDR (defaults: the standard
local ports). Failures print one line and exit non-zero, never a traceback.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import click
import grpc

from card.client.trio import LocalTrio
from card.common.channels import LOOPBACK, channel, health_status
from card.common.cli import client_context, exit_on_error, option, tls_options
from card.common.drafts import parse_pool_weights
from card.common.status import error_from_rpc
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.loading.models import DEFAULT_MODEL, QUANTIZE
from card.engine.shared.errors import CardError
from card.v1 import cache_pb2, cache_pb2_grpc, target_pb2, target_pb2_grpc

DEFAULT_TARGET_ADDR = "localhost:50051"
DEFAULT_CACHE_ADDR = "localhost:50052"
DEFAULT_DRAFT_ADDR = "localhost:50053"
RPC_TIMEOUT_S = 3.0
EXIT_NOT_SERVING = 1


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)


# ---- up ---------------------------------------------------------------------------------------
@click.command(context_settings=client_context())
@option("--target-model", default=DEFAULT_MODEL, envvar="CARD_CLIENT_TARGET_MODEL", show_default=True,
        help="Hugging Face id, local folder, .gguf file, or 'default' (embedded SmolLM2-135M).")
@option("--draft-model", default=DEFAULT_MODEL, envvar="CARD_CLIENT_DRAFT_MODEL", show_default=True)
@option("--draft-quantize", type=click.Choice(QUANTIZE), default=None, envvar="CARD_CLIENT_DRAFT_QUANTIZE",
        help="Default: int8 for the default draft, else none.")
@option("--draft-name", default=None, help="Name of the draft worker (default: derived).")
@option("--target-port", default=50051, show_default=True, type=int, help="0 = OS-chosen.")
@option("--cache-port", default=50052, show_default=True, type=int, help="0 = OS-chosen.")
@option("--draft-port", default=50053, show_default=True, type=int, help="0 = OS-chosen.")
@option("--http/--no-http", default=True, envvar="CARD_CLIENT_HTTP",
        help="Serve the target's OpenAI-compatible HTTP API; --no-http: gRPC alone.")
@option("--http-port", default=8000, show_default=True, type=int, envvar="CARD_CLIENT_HTTP_PORT",
        help="Port of the OpenAI API (vllm serve's; 0 = OS-chosen).")
@option("--http-host", default="127.0.0.1", show_default=True, envvar="CARD_CLIENT_HTTP_HOST",
        help="Interface of the OpenAI API (0.0.0.0: other machines too; then set --api-key).")
@option("--api-key", envvar="CARD_CLIENT_API_KEY", default=None,
        help="The target requires this key on both its APIs (OpenAI clients: api_key=...; card-client "
             "generate --target: the same variable). Prefer the variable: a command line is visible in ps.")
@option("--served-model-name", multiple=True, envvar="CARD_CLIENT_SERVED_MODEL_NAME",
        help="The name(s) OpenAI clients send as model (card-target --served-model-name; default: "
             "--target-model).")
@option("--target-threads", type=int, default=None, help="torch threads of the target.")
@option("--draft-threads", type=int, default=None, help="torch threads of the draft.")
@option("--redis-url", default=None, envvar="CARD_CLIENT_REDIS_URL",
        help="Use this Redis (default: start a private redis-server, or memory:// without one).")
@option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Where the services write their logs (default: a new temporary folder).")
@option("--dtype", default="auto", show_default=True)
@option("--device", default="auto", show_default=True)
@exit_on_error("card-client")
def up(target_model: str, draft_model: str, draft_quantize: str | None, draft_name: str | None,
       target_port: int, cache_port: int, draft_port: int, http: bool, http_port: int, http_host: str,
       api_key: str | None, served_model_name: tuple[str, ...], target_threads: int | None,
       draft_threads: int | None, redis_url: str | None, log_dir: Path | None, dtype: str,
       device: str) -> None:
    """Start redis, card-cache, card-draft and card-target here, the target's OpenAI API on
    --http-port; Ctrl-C stops them all."""
    if draft_quantize is None:
        draft_quantize = "int8" if draft_model == DEFAULT_MODEL else "none"
    if http and not api_key and http_host not in LOOPBACK:
        click.echo(f"warning: the OpenAI API listens on {http_host} without --api-key: anyone who reaches "
                   "it can generate (set CARD_CLIENT_API_KEY)", err=True)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="card-up-"))
    click.echo(f"starting the trio (logs in {log_dir}) ...", err=True)
    trio = LocalTrio(target_model=target_model, draft_model=draft_model, draft_quantize=draft_quantize,
                     draft_name=draft_name, target_port=target_port, cache_port=cache_port,
                     draft_port=draft_port, http_port=http_port if http else None,
                     http_host=http_host if http else None, api_key=api_key or None,
                     served_model_names=served_model_name, target_threads=target_threads,
                     draft_threads=draft_threads,
                     redis_url=redis_url, log_dir=log_dir, dtype=dtype, device=device)
    with trio:  # Ctrl-C while starting: KeyboardInterrupt stops whatever started
        click.echo(f"target  {trio.target_addr}  ({target_model})")
        click.echo(f"cache   {trio.cache_addr}  (redis {trio.redis_url})")
        click.echo(f"draft   {trio.draft_addr}  ({draft_model}, quantize {draft_quantize})")
        if trio.http_addr:
            model = (served_model_name and served_model_name[0].split(",")[0]) or target_model
            click.echo(f"http    http://{trio.http_addr}/v1  (OpenAI API, model {model})")
        click.echo(f"export CARD_CLIENT_TARGET_ADDR={trio.target_addr} "
                   f"CARD_CLIENT_CACHE_ADDR={trio.cache_addr} CARD_CLIENT_DRAFT_ADDR={trio.draft_addr}")
        click.echo("serving; Ctrl-C stops everything", err=True)
        sys.stdout.flush()
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            died = _watch(trio, stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        click.echo("stopping ...", err=True)
    if died:
        raise click.ClickException(died)
    click.echo("stopped", err=True)


def _watch(trio: LocalTrio, stop: threading.Event) -> str:
    """Wait for Ctrl-C; returns why the trio cannot go on if a service died first."""
    while not stop.wait(0.5):
        for p in trio.processes:
            code = p.proc.poll()
            if code is None:
                continue
            if p in trio.drafts:  # the target keeps serving (plain decoding) without a draft
                click.echo(f"warning: {p.name} exited with code {code}; see {p.log_path}", err=True)
                trio.processes.remove(p)
                trio.drafts.remove(p)
                break
            return f"{p.name} exited with code {code}; its log ({p.log_path}) ends with:\n{p.log_tail()}"
    return ""


# ---- status -----------------------------------------------------------------------------------
def _health(addr: str, tls: TlsConfig) -> str:
    try:
        return health_status(addr, timeout_s=RPC_TIMEOUT_S, tls=tls)
    except grpc.RpcError as err:
        code = err.code() if isinstance(err, grpc.Call) else None
        return "unreachable" if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
            else f"error {code.name if code else err}"


def _target_info(addr: str, tls: TlsConfig, api_key: str | None = None) -> str:
    try:
        with channel(addr, api_key, tls) as ch:
            info = target_pb2_grpc.TargetServiceStub(ch).Info(target_pb2.InfoRequest(), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        return str(error_from_rpc(err, addr))
    return (f"model {info.model}, tokenizer {info.tokenizer_fingerprint}, "
            f"context {info.context_window}")


def cache_status(addr: str, token: str | None = None, tls: TlsConfig = PLAINTEXT) -> cache_pb2.StatusResponse:
    """The cache's Status (registered drafts, live sessions, totals); CardError when it fails.
    ``token``: the cache's operator or target token, where it requires one."""
    try:
        with channel(addr, token, tls) as ch:
            stub = cache_pb2_grpc.CacheServiceStub(ch)
            return stub.Status(cache_pb2.StatusRequest(), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        raise error_from_rpc(err, addr) from None


def _totals_line(totals: dict[str, float]) -> str:
    if not totals:
        return "no finished sessions yet"
    corrections = sum(totals.get(k, 0.0) for k in ("hits", "secondary_hits", "misses"))
    parts = [f"{k} {v:g}" for k, v in sorted(totals.items())]
    if corrections:
        parts.append(f"hit rate {totals.get('hits', 0.0) / corrections:.0%}")
    if totals.get("target_forwards"):
        parts.append(f"mean accepted length {totals.get('new_tokens', 0.0) / totals['target_forwards']:.2f}")
    return ", ".join(parts)


@click.command(context_settings=client_context())
@option("--target", "target_addr", envvar="CARD_CLIENT_TARGET_ADDR", default=DEFAULT_TARGET_ADDR,
        show_default=True)
@option("--cache", "cache_addr", envvar="CARD_CLIENT_CACHE_ADDR", default=DEFAULT_CACHE_ADDR,
        show_default=True)
@option("--draft", "draft_addr", envvar="CARD_CLIENT_DRAFT_ADDR", default=DEFAULT_DRAFT_ADDR,
        show_default=True, help="Health address of one draft worker.")
@option("--target-token", envvar="CARD_CLIENT_TARGET_TOKEN", default=None,
        help="The cache's target token, where card-cache requires one (--target-token).")
@option("--operator-token", envvar="CARD_CLIENT_OPERATOR_TOKEN", default=None,
        help="The cache's operator token (its --operator-token); presented instead of --target-token.")
@option("--api-key", envvar="CARD_CLIENT_API_KEY", default=None,
        help="The target's key, where card-target requires one (its --api-key).")
@tls_options("card-client", serves=False, envvar_prefix="CARD_CLIENT")
@exit_on_error("card-client")
def status(target_addr: str, cache_addr: str, draft_addr: str, target_token: str | None,
           operator_token: str | None, api_key: str | None, tls: TlsConfig) -> None:
    """Health of each service, registered drafts, live sessions and totals from the cache."""
    rows = []
    health = {name: _health(addr, tls) for name, addr in
              (("target", target_addr), ("cache", cache_addr), ("draft", draft_addr))}
    target_detail = _target_info(target_addr, tls, api_key) if health["target"] != "unreachable" else ""
    cache_detail = ""
    reply: cache_pb2.StatusResponse | None = None
    if health["cache"] != "unreachable":
        try:
            reply = cache_status(cache_addr, operator_token or target_token, tls)
            cache_detail = (f"device {reply.cache_device}, redis "
                            f"{'connected' if reply.redis_connected else 'NOT connected'}, "
                            f"{len(reply.drafts)} draft(s), {len(reply.sessions)} live session(s)")
        except CardError as exc:
            cache_detail = str(exc)
    rows.append(("target", target_addr, health["target"], target_detail))
    rows.append(("cache", cache_addr, health["cache"], cache_detail))
    rows.append(("draft", draft_addr, health["draft"], ""))
    click.echo(_table(rows, ("service", "address", "health", "detail")))
    if reply is not None:
        click.echo("")
        click.echo(_pools_table(reply))
        click.echo("")
        click.echo(_drafts_table(reply))
        click.echo("")
        click.echo(f"totals: {_totals_line(dict(reply.totals))}")
    if any(h != "SERVING" for h in health.values()):
        sys.exit(EXIT_NOT_SERVING)


# ---- drafts -----------------------------------------------------------------------------------
def _ratio(num: float, den: float, fmt: str) -> str:
    return format(num / den, fmt) if den else "-"


def _pools_table(reply: cache_pb2.StatusResponse) -> str:
    """One row per pool: its workers now and what the target made of its chains (this cache
    replica's sessions): hit rate, accepted length (tokens per verified chain), tokens per
    target step, and the pace those steps kept (tok/s)."""
    if not reply.pools:
        return "no draft pools"
    rows = [(p.name, f"{p.weight:g}", f"{p.live_workers}/{p.workers}", f"{p.active_sessions}/{p.capacity}",
             str(p.steps), _ratio(p.hits, p.steps, ".0%"),
             _ratio(p.accepted_tokens + p.chains, p.chains, ".2f"),
             _ratio(p.committed_tokens, p.steps, ".2f"), _ratio(p.committed_tokens, p.busy_s, ".1f"))
            for p in reply.pools]
    return _table(rows, ("pool", "weight", "live/workers", "sessions", "steps", "hit rate", "accepted length",
                         "tokens/step", "tok/s"))


def _drafts_table(reply: cache_pb2.StatusResponse) -> str:
    if not reply.drafts:
        return "no draft workers registered"
    now = time.time()
    rows = [(d.name, d.pool, "draining" if d.draining else "serving" if d.live else "connecting", d.model,
             d.tokenizer_fingerprint, f"{d.active_sessions}/{d.capacity}",
             f"{max(0.0, now - d.last_heartbeat_unix):.1f}s ago" if d.last_heartbeat_unix else "-")
            for d in reply.drafts]
    return _table(rows, ("draft", "pool", "state", "model", "tokenizer", "sessions", "heartbeat"))


def _cache_options(fn: Callable[..., None]) -> Callable[..., None]:
    fn = tls_options("card-client", serves=False, envvar_prefix="CARD_CLIENT")(fn)
    fn = option("--operator-token", envvar="CARD_CLIENT_OPERATOR_TOKEN", default=None,
                help="card-cache's --operator-token, where it has one (drain, resume, weights).")(fn)
    fn = option("--target-token", envvar="CARD_CLIENT_TARGET_TOKEN", default=None,
                help="card-cache's --target-token, where it has one (enough to list).")(fn)
    return option("--cache", "cache_addr", envvar="CARD_CLIENT_CACHE_ADDR", default=DEFAULT_CACHE_ADDR,
                  show_default=True)(fn)


@click.group(invoke_without_command=True, context_settings=client_context())
@_cache_options
@click.pass_context
@exit_on_error("card-client")
def drafts(ctx: click.Context, cache_addr: str, target_token: str | None, operator_token: str | None,
           tls: TlsConfig) -> None:
    """Draft pools and workers registered with the cache service: each pool's workers, capacity,
    live sessions and acceptance (to compare two draft models serving the same target), then
    each worker. The drain and resume commands take workers out of (and back into) service."""
    if ctx.invoked_subcommand is None:
        reply = cache_status(cache_addr, operator_token or target_token, tls)
        click.echo(_pools_table(reply))
        click.echo("")
        click.echo(_drafts_table(reply))


def _drain(cache_addr: str, operator_token: str | None, tls: TlsConfig, name: str | None, pool: str | None,
           resume: bool) -> None:
    if bool(name) == bool(pool):
        raise click.UsageError("give one worker NAME or --pool POOL")
    try:
        with channel(cache_addr, operator_token, tls) as ch:
            reply = cache_pb2_grpc.CacheServiceStub(ch).Drain(
                cache_pb2.DrainRequest(name=name or "", pool=pool or "", resume=resume),
                timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        raise error_from_rpc(err, cache_addr) from None
    verb = "resumed" if resume else "drained"
    moved = "" if resume else f"; {reply.sessions_moved} live session(s) moved to other workers"
    click.echo(f"{verb} {', '.join(reply.workers)}{moved}")


@drafts.command("drain", context_settings=client_context())
@click.argument("name", required=False)
@option("--pool", default=None, help="Drain every worker of this pool.")
@_cache_options
@exit_on_error("card-client")
def drain(name: str | None, pool: str | None, cache_addr: str, target_token: str | None,
          operator_token: str | None, tls: TlsConfig) -> None:
    """Stop giving sessions to worker NAME (or every worker of --pool) and move its live sessions
    to other workers, its pool's first; the process keeps running (before a rollout, or to compare
    pools). Output never changes: the target verifies every token."""
    _drain(cache_addr, operator_token, tls, name, pool, resume=False)


@drafts.command("weights", context_settings=client_context())
@click.argument("weights")
@_cache_options
@exit_on_error("card-client")
def weights(weights: str, cache_addr: str, target_token: str | None, operator_token: str | None,
            tls: TlsConfig) -> None:
    """Split unnamed sessions between pools by WEIGHTS, e.g. 'stable=90,canary=10' ('' = the
    least-loaded worker of any pool). Takes effect at once for new sessions, without a restart;
    the cache's --pool-weights is what it starts with."""
    parsed = parse_pool_weights(weights)  # the cache checks them too; a typo fails here first
    try:
        with channel(cache_addr, operator_token, tls) as ch:
            reply = cache_pb2_grpc.CacheServiceStub(ch).SetPoolWeights(
                cache_pb2.PoolWeightsRequest(weights=dict(parsed)), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        raise error_from_rpc(err, cache_addr) from None
    now = ", ".join(f"{p}={w:g}" for p, w in sorted(reply.weights.items()))
    click.echo(f"pool weights: {now or 'none (least-loaded worker of any pool)'}")


@drafts.command("resume", context_settings=client_context())
@click.argument("name", required=False)
@option("--pool", default=None, help="Resume every worker of this pool.")
@_cache_options
@exit_on_error("card-client")
def resume(name: str | None, pool: str | None, cache_addr: str, target_token: str | None,
           operator_token: str | None, tls: TlsConfig) -> None:
    """Undo a drain: worker NAME (or every worker of --pool) takes sessions again."""
    _drain(cache_addr, operator_token, tls, name, pool, resume=True)
