"""What every command line shares: environment variables by one rule, one error exit, logging flags.

Every service option reads ``CARD_<SERVICE>_<OPTION>`` (click's ``auto_envvar_prefix``, so no
option can drift from the rule) and ``--help`` shows the variable beside the flag.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click
import grpc

from card_common.status import error_from_rpc
from card_common.tls import TlsConfig
from engine.errors import CardError
from engine.ngram import NgramConfig

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130

option = functools.partial(click.option, show_envvar=True)


def service_command(env_prefix: str) -> Callable[[Callable[..., Any]], click.Command]:
    """``@click.command`` whose options read ``<env_prefix>_<OPTION>`` (e.g. CARD_CACHE_PORT)."""
    return click.command(context_settings={
        "help_option_names": ["-h", "--help"], "show_default": True, "auto_envvar_prefix": env_prefix,
    })


def logging_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--log-level`` and ``--json-logs``, the same on every service."""
    fn = option("--json-logs", is_flag=True, help="One JSON object per log line.")(fn)
    return option("--log-level", default="INFO",
                  type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))(fn)


@contextlib.contextmanager
def exit_on_error(program: str) -> Iterator[None]:
    """Failures a person can fix (bad flags or input, a taken port, a missing model, a peer that is
    down) become one line on stderr, ``PROGRAM: CODE: message``, and exit code 2, never a
    traceback; Ctrl-C exits 130. Every command of the project (services, card-client, card-bench)
    ends this way."""
    try:
        yield
    except CardError as exc:
        _fail(program, exc)
    except grpc.RpcError as err:  # a peer's status, said the way the project says its own
        _fail(program, error_from_rpc(err))
    except OSError as exc:  # e.g. a port that is taken, a file that cannot be written
        print(f"{program}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print(f"\n{program}: interrupted", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)


def _fail(program: str, exc: CardError) -> None:
    print(f"{program}: {exc.code}: {exc}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def exits_on_error(program: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``exit_on_error`` as a decorator, for click commands."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with exit_on_error(program):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def tls_options(program: str, *, serves: bool = True, dials: bool = True,
                envvar_prefix: str | None = None) -> Callable[[Callable[..., Any]], Any]:
    """The TLS flags (card_common.tls), the same on every command; the command receives one
    ``tls: TlsConfig`` (and ``health_port`` where it serves) instead of the separate flags.
    A file that cannot be read exits 2 with one line, like every other startup error.
    ``envvar_prefix``: for commands without ``auto_envvar_prefix`` (card-client's CARD_CLIENT)."""

    def option(*decls: str, **kw: Any) -> Callable[[Callable[..., Any]], Any]:
        if envvar_prefix:
            kw["envvar"] = f"{envvar_prefix}_{decls[0].lstrip('-').replace('-', '_').upper()}"
        return click.option(*decls, show_envvar=True, **kw)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, tls_cert: str | None, tls_key: str | None, tls_ca: str | None,
                    tls_client_auth: bool = False, tls_server_name: str | None = None, **kw: Any) -> Any:
            with exit_on_error(program):
                tls = TlsConfig(cert=tls_cert or None, key=tls_key or None, ca=tls_ca or None,
                                client_auth=tls_client_auth, server_name=tls_server_name or None)
            return fn(*args, tls=tls, **kw)

        path = click.Path(dir_okay=False)
        if serves:
            wrapper = option("--health-port", type=int, default=None,
                             help="Also serve grpc.health.v1 alone, in plaintext, on this port (same "
                                  "--host): for probes that cannot speak TLS, such as the kubelet's "
                                  "gRPC probe. "
                                  "Default: off.")(wrapper)
            wrapper = option("--tls-client-auth", is_flag=True,
                             help="Mutual TLS: refuse clients without a certificate signed by "
                                  "--tls-ca.")(wrapper)
        if dials:
            wrapper = option("--tls-server-name", default=None,
                             help="Name to check in the certificate of the server this process dials, where "
                                  "the address is not that name (an IP, a port-forward).")(wrapper)
        role = ("serves (TLS on its gRPC port) and presents where a server asks for a client "
                "certificate" if serves and dials else "serves (TLS on its gRPC port)" if serves
                else "presents to servers that ask for a client certificate (mutual TLS)")
        wrapper = option("--tls-ca", type=path, default=None,
                         help="PEM bundle of the CA that signed the peers: verifies "
                              + ("the servers this process dials (TLS on; without it, the system's roots "
                                 "if --tls-cert is set)" if dials else "")
                              + (" and " if dials and serves else "")
                              + ("client certificates (--tls-client-auth)" if serves else ""))(wrapper)
        wrapper = option("--tls-key", type=path, default=None, help="PEM private key of --tls-cert.")(wrapper)
        return option("--tls-cert", type=path, default=None,
                      help=f"PEM certificate chain this process {role}. Default: plaintext.")(wrapper)

    return decorate


def ngram_options(program: str, envvar_prefix: str | None = None) -> Callable[[Callable[..., Any]], Any]:
    """The n-gram drafter's settings (engine.ngram.NgramConfig) as ``--ngram-*`` flags, passed to
    the command as ``ngram``; the same on card-draft, card-client and card-bench.
    ``envvar_prefix``: for commands without ``auto_envvar_prefix`` (card-client's CARD_CLIENT)."""
    defaults = NgramConfig()

    def option(*decls: str, **kw: Any) -> Callable[[Callable[..., Any]], Any]:
        if envvar_prefix:
            kw["envvar"] = f"{envvar_prefix}_{decls[0].lstrip('-').replace('-', '_').upper()}"
        return click.option(*decls, show_envvar=True, show_default=True, **kw)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, ngram_max_order: int, ngram_min_order: int, ngram_table_mb: float,
                    ngram_corpus: str | None, ngram_lookahead: int, **kw: Any) -> Any:
            with exit_on_error(program):
                ngram = NgramConfig(max_order=ngram_max_order, min_order=ngram_min_order,
                                    table_mb=ngram_table_mb, corpus=ngram_corpus or None,
                                    lookahead=ngram_lookahead)
            return fn(*args, ngram=ngram, **kw)

        wrapper = option("--ngram-lookahead", type=int, default=defaults.lookahead,
                         help="Cascade: n-gram tokens the draft model checks below each node it "
                              "expands, in the same forward.")(wrapper)
        wrapper = option("--ngram-corpus", type=click.Path(dir_okay=False), default=None,
                         help="Text file whose n-grams warm the shared table at start (paragraphs "
                              "split at blank lines).")(wrapper)
        wrapper = option("--ngram-table-mb", type=float, default=defaults.table_mb,
                         help="Memory of the n-gram table shared by all sessions (least recently used "
                              "n-grams go first); 0: each session drafts from its own text only.")(wrapper)
        wrapper = option("--ngram-min-order", type=int, default=defaults.min_order,
                         help="Shortest n-gram matched.")(wrapper)
        return option("--ngram-max-order", type=int, default=defaults.max_order,
                      help="Longest n-gram matched (the longest match a table knows wins).")(wrapper)

    return decorate
