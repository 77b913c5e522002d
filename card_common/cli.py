"""What every command line shares: environment variables by one rule, one error exit, logging flags.

Every option reads ``CARD_<PROGRAM>_<OPTION>`` (click's ``auto_envvar_prefix``, so no option can
drift from the rule): the services' CARD_TARGET_*, CARD_DRAFT_*, CARD_CACHE_*, card-client's
CARD_CLIENT_* and card-bench's CARD_BENCH_*; ``--help`` shows the variable beside the flag. A
flag shared by several commands has its help written once, here, short: the explanation that
would repeat in every command's --help lives in docs/usage.md.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click
import grpc

from card.common.status import error_from_rpc
from card.common.tls import TlsConfig
from card.engine.loading.panel_gemm import KERNELS as CPU_LINEAR
from card.engine.shared.config import MAX_CHAIN, MAX_TREE_DEPTH, NgramConfig
from card.engine.shared.errors import CardError
from card.engine.shared.row_attention import SETTINGS as CPU_ATTENTION

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130

option = functools.partial(click.option, show_envvar=True)


def service_command(env_prefix: str) -> Callable[[Callable[..., Any]], click.Command]:
    """``@click.command`` whose options read ``<env_prefix>_<OPTION>`` (e.g. CARD_CACHE_PORT)."""
    return click.command(context_settings={
        "help_option_names": ["-h", "--help"], "show_default": True, "auto_envvar_prefix": env_prefix,
    })


CLIENT_ENV = "CARD_CLIENT"


def client_context(**settings: Any) -> dict[str, Any]:
    """The context_settings of a card-client command: its options read CARD_CLIENT_<OPTION> (a
    subcommand would otherwise read CARD_CLIENT_<COMMAND>_<OPTION>, click's nesting), so one
    variable means one thing to every command (CARD_CLIENT_TARGET_ADDR, CARD_CLIENT_API_KEY ...)."""
    return {"help_option_names": ["-h", "--help"], "auto_envvar_prefix": CLIENT_ENV, **settings}


def exact_option(envvar_prefix: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--exact on|off`` -> ``exact: bool``, the same on card-target, card-client and card-bench.
    ``envvar_prefix``: for commands without ``auto_envvar_prefix`` (card-client's CARD_CLIENT)."""
    return option(
        "--exact", type=click.Choice(["on", "off"]), default="on", show_default=True,
        envvar=f"{envvar_prefix}_EXACT" if envvar_prefix else None,
        callback=lambda _ctx, _param, value: value == "on",
        help="on: batch-invariant kernels, so every output equals the request served alone by plain "
             "decoding, at any load. off: the vendor kernels; outputs may change with the load (stats "
             "say exact=false). Measured cost of on: 3-4% on the CPU (bf16); on one H100, eager, "
             "plain decoding at 0.70x (8 in flight) and 0.34x (32) of vendor (docs/performance.md).")


def cpu_linear_option(envvar_prefix: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--cpu-linear auto|onednn|panel``: the kernel of a CPU model's fp32 linears, the same on
    card-target, card-draft and card-bench (ModelConfig.cpu_linear)."""
    return option(
        "--cpu-linear", type=click.Choice(list(CPU_LINEAR)), default="auto", show_default=True,
        envvar=f"{envvar_prefix}_CPU_LINEAR" if envvar_prefix else None,
        help="The CPU's fp32 linears: onednn (oneDNN's packed matmul), panel (the project's AVX2 kernel, "
             "built with the system C compiler on first use; streams a decoding step's weights ~1.5-2x "
             "faster on AVX2 machines), or auto (panel on AVX2 CPUs without AVX-512 where it builds, "
             "oneDNN elsewhere). Either is batch-invariant; the choice depends on the machine only.")


def cpu_attention_option(
        envvar_prefix: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--cpu-attention auto|torch|kernel``: the exact attention of a CPU target, the same on
    card-target and card-bench (ModelConfig.cpu_attention)."""
    return option(
        "--cpu-attention", type=click.Choice(list(CPU_ATTENTION)), default="auto", show_default=True,
        envvar=f"{envvar_prefix}_CPU_ATTENTION" if envvar_prefix else None,
        help="The exact attention of a target on the CPU (fp32, bf16, fp16): kernel (the project's AVX2 "
             "kernel, built with the system C compiler on first use; one call a layer for every decoding, "
             "verifying and prompt row), torch (batched torch ops), or auto (kernel for fp32 where it builds "
             "and its start-up probe passes; bf16 and fp16 keep torch, whose bf16 matmuls prefill "
             "faster). Both are batch-invariant; their bits differ, so every replica serving one model "
             "should run the same.")


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
    ends this way. A context manager, and a decorator of click commands alike."""
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


def tls_options(program: str, *, serves: bool = True, dials: bool = True,
                envvar_prefix: str | None = None) -> Callable[[Callable[..., Any]], Any]:
    """The TLS flags (card.common.tls), the same on every command; the command receives one
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
                             help="Plaintext grpc.health.v1 alone on this port too, for probes that "
                                  "cannot speak TLS. Default: off.")(wrapper)
            wrapper = option("--tls-client-auth", is_flag=True,
                             help="Mutual TLS: clients need a certificate signed by --tls-ca.")(wrapper)
        if dials:
            wrapper = option("--tls-server-name", default=None,
                             help="Name expected in the dialed server's certificate (default: the "
                                  "host dialed).")(wrapper)
        trusted = " and ".join((["servers dialed"] if dials else []) + (["client certificates"] if serves
                                                                        else []))
        wrapper = option("--tls-ca", type=path, default=None,
                         help=f"PEM CA bundle that verifies {trusted}.")(wrapper)
        wrapper = option("--tls-key", type=path, default=None, help="PEM private key of --tls-cert.")(wrapper)
        what = ("PEM certificate chain served on the gRPC port, presented to servers that ask. Default: "
                "plaintext." if serves and dials else
                "PEM certificate chain served on the gRPC port. Default: plaintext." if serves else
                "PEM client certificate, for servers that require one (mutual TLS).")
        return option("--tls-cert", type=path, default=None, help=what)(wrapper)

    return decorate


def ngram_options(program: str, envvar_prefix: str | None = None) -> Callable[[Callable[..., Any]], Any]:
    """The n-gram drafter's settings (card.engine.draft.ngram.NgramConfig) as ``--ngram-*`` flags, passed to
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


# The tree flags: (flag, TreeParams field, click type, help). One declaration for every command.
_TREE_FLAGS: dict[str, tuple[str, Any, str]] = {
    "width": ("--tree-width", click.IntRange(1, 64),
              "K: primary nodes per draft layer (default: 3 on CPU, 4 on GPU)."),
    "branch": ("--branch", click.IntRange(0, 64),
               "k: secondary children kept per expanded node (default: 4 on CPU, K on GPU)."),
    "max_depth": ("--max-depth", click.IntRange(1, MAX_TREE_DEPTH),
                  "Draft layers grown below the root before idling (default 8; model-free 24)."),
    "max_chain": ("--max-chain", click.IntRange(0, MAX_CHAIN),
                  "Most drafted tokens verified per target forward (default: 6 on CPU, 8 on GPU; "
                  "model-free 12)."),
    "b_extension": ("--b-extension/--no-b-extension", None,
                    "Extend each chain by the best secondary-tier token (default: on)."),
    "min_path_prob": ("--min-path-prob", click.FloatRange(0.0, 1.0),
                      "Cut chains where the draft's prefix probability falls below this "
                      "(default: 0, never)."),
}
DRAFT_SHAPE = ("width", "branch", "max_depth")  # the draft worker's to choose
CHAIN_FIELDS = ("max_chain", "b_extension", "min_path_prob")  # a session's (the cache's, or a request's)


def _param(field_name: str) -> str:
    """The flag's parameter (and so its CARD_* variable) name: --tree-width for the field width."""
    return "tree_width" if field_name == "width" else field_name


def tree_options(fields: tuple[str, ...] = DRAFT_SHAPE + CHAIN_FIELDS, envvar_prefix: str | None = None,
                 note: str = "") -> Callable[[Callable[..., Any]], Any]:
    """The tree flags (engine.shared.config.TreeParams) named by ``fields``, the same types and
    help on every command; the command receives ``tree_flags``: the flags that were given, by
    field (pass them to ``tree_params(device, kind, **tree_flags)``). ``note`` ends the first
    flag's help (what the command does with them). ``envvar_prefix``: for commands without
    ``auto_envvar_prefix`` (card-client's CARD_CLIENT, card-bench's CARD_BENCH)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kw: Any) -> Any:
            given = {f: kw.pop(_param(f)) for f in fields}
            return fn(*args, tree_flags={f: v for f, v in given.items() if v is not None}, **kw)

        for i, field_name in enumerate(reversed(fields)):
            flag, kind, help_text = _TREE_FLAGS[field_name]
            if i == len(fields) - 1 and note:
                help_text = f"{help_text} {note}"
            kw: dict[str, Any] = {"default": None, "help": help_text, "show_envvar": True}
            if kind is not None:
                kw["type"] = kind
            if envvar_prefix:
                kw["envvar"] = f"{envvar_prefix}_{_param(field_name).upper()}"
            decls = [flag, *(["-K"] if field_name == "width" else []), _param(field_name)]
            wrapper = click.option(*decls, **kw)(wrapper)
        return wrapper

    return decorate
