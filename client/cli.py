"""``card-client``: generate text (in-process or through the services) and operate the trio."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from card.client import ops
from card.client.options import DEFAULT_DRAFT, GenerateOptions
from card.common.cli import (
    DRAFT_SHAPE,
    client_context,
    exact_option,
    exit_on_error,
    ngram_options,
    option,
    tls_options,
    tree_options,
)
from card.common.tls import TlsConfig
from card.engine.loading.models import DEFAULT_MODEL, DTYPES, QUANTIZE, ModelConfig, export_checkpoint
from card.engine.shared.config import (
    NGRAM,
    ChainPolicy,
    Constraint,
    DrafterKind,
    Mode,
    NgramConfig,
    SamplingParams,
    StopParams,
    Verify,
    check_logprobs,
    tree_params,
)
from card.engine.shared.errors import InvalidArgument


def _logit_bias(ctx: click.Context, param: click.Parameter,
                values: tuple[str, ...]) -> tuple[tuple[int, float], ...]:
    try:
        return tuple((int(t), float(b)) for t, _, b in (v.partition("=") for v in values))
    except ValueError:
        raise click.BadParameter("write each entry as TOKEN_ID=BIAS, e.g. 198=-100") from None


def _constraint(ctx: click.Context, param: click.Parameter, value: str | None) -> Constraint | None:
    """``KIND=TEXT`` (TEXT, or ``@FILE`` for a file's text) as the request's output constraint."""
    if not value:
        return None
    kind, sep, text = value.partition("=")
    if not sep:
        raise click.BadParameter("write KIND=TEXT or KIND=@FILE, e.g. regex='[0-9]+' or "
                                 "json_schema=@schema.json")
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise click.BadParameter(f"cannot read {text[1:]}: {exc.strerror or exc}") from None
    try:
        return Constraint(kind, text)
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc)) from None


# the request's logits processors: flag, click settings (vLLM's sampling parameters; docs/engine.md)
_PROCESSOR_FLAGS: dict[str, dict[str, Any]] = {
    "--min-p": dict(default=0.0, type=float,
                    help="Drop tokens less likely than this fraction of the likeliest (sampled requests)."),
    "--repetition-penalty": dict(default=1.0, type=float,
                                 help="Penalize tokens of the prompt and the output (> 1 discourages them)."),
    "--presence-penalty": dict(default=0.0, type=float, help="Subtract from tokens the output holds."),
    "--frequency-penalty": dict(default=0.0, type=float,
                                help="Subtract, times their count, from tokens the output holds."),
    "--logit-bias": dict(multiple=True, callback=_logit_bias, metavar="ID=BIAS",
                         help="Add BIAS (-100 to 100) to token ID's logit (repeatable)."),
    "--min-tokens": dict(default=0, type=int, help="Hold EOS back until this many tokens are generated."),
    "--constraint": dict(default=None, callback=_constraint, metavar="KIND=TEXT",
                         help="Constrain the output (structured outputs): json_schema=SCHEMA, json_object=, "
                              "regex=RE, choice=JSON_LIST or grammar=LARK; TEXT or @FILE."),
}


def logits_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The logits processors' flags, given to the command as ``processors``: SamplingParams'
    fields (which check them)."""
    names = [flag[2:].replace("-", "_") for flag in _PROCESSOR_FLAGS]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        return fn(*args, processors={n: kw.pop(n) for n in names}, **kw)

    for flag, kw in reversed(_PROCESSOR_FLAGS.items()):
        wrapper = option(flag, show_default=not kw.get("multiple"), **kw)(wrapper)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@option("--log-level", default="WARNING", envvar="CARD_CLIENT_LOG_LEVEL", show_default=True,
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def cli(log_level: str) -> None:
    """CARD serving: exact speculative decoding with a draft, a cache and a target service."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if logging.getLevelName(log_level.upper()) > logging.INFO:
        # transformers warns about sequence lengths itself; the engine's own check says it better
        import transformers

        transformers.logging.set_verbosity_error()


@cli.command(context_settings=client_context())
@click.argument("prompt")
@option("--inprocess", is_flag=True, help="Run draft and target in this process (no services).")
@option("--target", "target_addr", envvar="CARD_CLIENT_TARGET_ADDR", default=None,
        help="Address of a running card-target (HOST:PORT). Unset: use a local trio.")
@option("--api-key", envvar="CARD_CLIENT_API_KEY", default=None,
        help="The key of a --target that has one (its --api-key), presented as 'authorization: Bearer' "
             "(prefer the variable: a command line is visible in ps).")
@option("--draft", "draft_name", default=None,
        help="The draft pool to speculate with (or one worker's name; services). Default: any pool whose "
             "tokenizer matches.")
@option("--mode", type=click.Choice(["card", "card-auto", "sd", "vanilla"]), default="card",
        show_default=True,
        help="card-auto: per request, model-free drafting (the text's own n-grams, no draft forward) or the "
             "draft model, whichever commits faster.")
@option("--target-model", default=DEFAULT_MODEL, envvar="CARD_CLIENT_TARGET_MODEL", show_default=True,
        help="Hugging Face id, local folder, .gguf file, or 'default' (embedded SmolLM2-135M).")
@option("--draft-model", default=DEFAULT_DRAFT.spec, envvar="CARD_CLIENT_DRAFT_MODEL", show_default=True,
        help="Draft model spec, or 'ngram': model-free drafting from n-gram statistics of the prompt and "
             "what was generated (no draft model).")
@option("--cascade", type=click.Choice(["none", NGRAM]), default="none", envvar="CARD_CLIENT_CASCADE",
        show_default=True,
        help="ngram: n-gram statistics beneath the draft model, whose forwards also check their "
             "continuations.")
@option("--draft-quantize", type=click.Choice(QUANTIZE), default=None,
        help=f"Quantize the draft (default draft: {DEFAULT_DRAFT.quantize}; others: none).")
@option("--dtype", default="auto", show_default=True, help="auto, float32, bfloat16, float16.")
@option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N.")
@option("--max-new-tokens", default=128, show_default=True, type=int)
@option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@option("--top-k", default=0, show_default=True, type=int, help="0 disables top-k.")
@option("--top-p", default=1.0, show_default=True, type=float)
@option("--seed", default=None, type=int,
        help="Seed of the sampled draws (--temperature > 0); the same seed gives the same text in every "
             "mode. Default: a fresh one, printed with the stats (--json: \"seed\") to replay it.")
@option("--stop", "stop", multiple=True, help="Stop before this string (repeatable).")
@option("--stop-token-id", "stop_token_ids", multiple=True, type=int,
        help="Stop at this token id (repeatable; kept in the token ids, its text left out).")
@option("--include-stop-str", is_flag=True,
        help="End the text with the stop string or stop token's text that ended it.")
@option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@logits_options
@tree_options((*DRAFT_SHAPE, "max_chain", "min_path_prob"),
              note="Draft-shape flags (--tree-width, --branch, --max-depth) reach --inprocess runs and a "
                   "local trio's card-draft; with --target they are refused (set them where card-draft "
                   "runs). Chain flags (--max-chain, --min-path-prob) also travel with each request to "
                   "--target.")
@option("--backoff/--no-backoff", default=True, show_default=True,
        help="--inprocess card: pause a draft that keeps missing or makes the target slower "
        "than alone (docs/engine.md); --no-backoff drafts throughout.")
@option("--gamma", default=4, show_default=True, type=int, help="Chain length of --mode sd.")
@option("--chat/--no-chat", default=None, help="Apply the chat template (default: when there is one).")
@option("--target-threads", type=int, default=None, help="torch threads of the target.")
@option("--draft-threads", type=int, default=None, help="torch threads of the draft.")
@option("--verify", type=click.Choice([v.value for v in Verify]), default="exact", show_default=True,
        envvar="CARD_CLIENT_VERIFY",
        help="How the target judges drafted tokens: exact (the output is plain decoding's, token for "
             "token), rejection (sampled requests: speculative sampling on chains drawn from the draft; "
             "each token follows the target's distribution, more drafted tokens are kept, but they are "
             "not plain decoding's tokens for the seed; greedy requests are verified exactly) or loose "
             "(FLy: lossy; keeps a differently worded continuation the target agrees with, and the "
             "stats say so).")
@option("--loose-entropy-threshold", type=float, default=None, envvar="CARD_CLIENT_LOOSE_ENTROPY_THRESHOLD",
        help="--verify loose: the target's top-3 entropy (nats) at or above which a mismatch may be kept "
             "(default: the target's; in process FLy's 0.3).")
@option("--loose-window", type=int, default=None, envvar="CARD_CLIENT_LOOSE_WINDOW",
        help="--verify loose: a kept mismatch and the drafted tokens after it the target must agree with "
             "(default: the target's; in process FLy's 6).")
@option("--logprobs", type=int, default=None, envvar="CARD_CLIENT_LOGPROBS",
        help="Report each token's log-probability with this many alternatives (0-20) in --json output.")
@option("--json", "as_json", is_flag=True, envvar="CARD_CLIENT_JSON",
        help="Print one JSON object: text, token_ids, stats.")
@option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=600.0,
        show_default=True, envvar="CARD_CLIENT_TIMEOUT",
        help="Seconds the whole generation may take through the services (the gRPC deadline); past it "
             "the command fails, naming it.")
@exact_option("CARD_CLIENT")
@ngram_options("card-client", envvar_prefix="CARD_CLIENT")
@tls_options("card-client", serves=False, envvar_prefix="CARD_CLIENT")
@exit_on_error("card-client")
def generate(prompt: str, inprocess: bool, target_addr: str | None, api_key: str | None,
             draft_name: str | None, mode: str,
             target_model: str, draft_model: str, cascade: str, draft_quantize: str | None, dtype: str,
             device: str,
             max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
             stop: tuple[str, ...], stop_token_ids: tuple[int, ...], include_stop_str: bool,
             ignore_eos: bool, processors: dict[str, Any], tree_flags: dict[str, object],
             backoff: bool, gamma: int, chat: bool | None, target_threads: int | None,
             draft_threads: int | None, verify: str, loose_entropy_threshold: float | None,
             loose_window: int | None, logprobs: int | None,
             as_json: bool, timeout_s: float, exact: bool, tls: TlsConfig, ngram: NgramConfig) -> None:
    """Generate text for PROMPT, streaming it as the target commits it; a stats line follows."""
    if draft_quantize is None:
        draft_quantize = DEFAULT_DRAFT.quantize if draft_model == DEFAULT_DRAFT.spec else "none"
    drafter = DrafterKind.from_flags(draft_model, cascade)
    if mode == Mode.CARD_AUTO.value and drafter is not DrafterKind.NEURAL:
        raise click.UsageError("--mode card-auto chooses between model-free drafting and the draft "
                               "model: drop --draft-model ngram / --cascade")
    drafter.check_mode(Mode(mode))
    sampling = SamplingParams(temperature, top_k, top_p, 0 if seed is None else seed, **processors)
    drawn = seed is None and not sampling.greedy
    if drawn:  # as card-target does for a request without one: 63 bits from the OS's generator
        sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
    draft_shape = tuple(f"--{'tree-width' if f == 'width' else f.replace('_', '-')}"
                        for f in DRAFT_SHAPE if f in tree_flags)
    opts = GenerateOptions(
        prompt=prompt,
        mode=Mode(mode),
        target=ModelConfig(target_model, dtype, device, exact=exact),
        draft=ModelConfig(draft_model, dtype, device, draft_quantize),
        sampling=sampling,
        stop=StopParams(max_new_tokens, tuple(stop), ignore_eos, tuple(stop_token_ids), include_stop_str),
        tree=tree_params(device, drafter, **tree_flags),
        chain=ChainPolicy(max_chain=tree_flags.get("max_chain"),  # type: ignore[arg-type]
                          min_path_prob=tree_flags.get("min_path_prob")),  # type: ignore[arg-type]
        draft_shape=draft_shape,
        gamma=gamma,
        backoff=backoff,
        chat=chat,
        target_threads=target_threads,
        draft_threads=draft_threads,
        draft_name=draft_name,
        drafter=drafter,
        ngram=ngram,
        verify=Verify.parse(verify),
        loose_entropy_threshold=loose_entropy_threshold,
        loose_window=loose_window,
        logprobs=logprobs,
    )
    opts.verify_policy()  # bad loose settings are refused before anything loads
    check_logprobs(logprobs)  # the bound the target applies, before anything loads
    on_text = None if as_json else _echo_text
    if inprocess:
        from card.client.inprocess import generate_inprocess

        result = generate_inprocess(opts, on_text)
    else:
        from card.client.services import generate_via_services

        result = generate_via_services(opts, target_addr, on_text, tls, api_key or None, timeout_s)
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "seed": sampling.seed}))
    else:
        click.echo("")
        click.echo(result.stats.summary() + (f", seed {sampling.seed} (--seed replays it)" if drawn else ""),
                   err=True)


@cli.command()  # no CARD_CLIENT_* variables: its --dtype is not generate's (no auto)
@click.argument("spec")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
@exit_on_error("card-client")
def export(spec: str, dest: Path, dtype: str) -> None:
    """Save SPEC (a .gguf file, a folder, an HF id) as a checkpoint folder DEST that loads fast."""
    loaded = export_checkpoint(spec, dest, dtype)
    click.echo(f"wrote {dest} ({loaded.name}, {dtype}); use it as a model spec")


def _echo_text(text: str) -> None:
    click.echo(text, nl=False)
    sys.stdout.flush()


for _command in (ops.up, ops.status, ops.drafts):  # operator commands live with the services client
    cli.add_command(_command)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cli(prog_name="card-client")


if __name__ == "__main__":
    main()
