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
from engine.errors import CardError

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
