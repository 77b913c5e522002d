"""``card-client``: generate text (in-process or through the services) and operate the trio."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click

from card_common.cli import exits_on_error, ngram_options, option, tls_options
from card_common.tls import TlsConfig
from client import ops
from client.options import DEFAULT_DRAFT, GenerateOptions, drafter_of
from engine.config import ChainPolicy, SamplingParams, StopParams, tree_params
from engine.loading.models import DEFAULT_MODEL, DTYPES, QUANTIZE, ModelConfig, export_checkpoint
from engine.ngram import NGRAM, NgramConfig


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


@cli.command()
@click.argument("prompt")
@option("--inprocess", is_flag=True, help="Run draft and target in this process (no services).")
@option("--target", "target_addr", envvar="CARD_CLIENT_TARGET_ADDR", default=None,
        help="Address of a running card-target (HOST:PORT). Unset: use a local trio.")
@option("--draft", "draft_name", default=None, help="Name of the draft worker to use (services).")
@option("--mode", type=click.Choice(["card", "sd", "vanilla"]), default="card", show_default=True)
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
@option("--seed", default=0, show_default=True, type=int)
@option("--stop", "stop", multiple=True, help="Stop before this string (repeatable).")
@option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@option("--tree-width", "-K", default=None, type=int,
        help="K: primary nodes per draft layer (default: 3 on CPU, 4 on GPU). Draft-shape flags "
             "(--tree-width, --branch, --max-depth) reach --inprocess runs and a local trio's "
             "card-draft; with --target they are refused (set them where card-draft runs).")
@option("--branch", default=None, type=int,
        help="k: secondary children per expanded node (default: 4 on CPU, K on GPU).")
@option("--max-depth", default=None, type=int, help="Draft layers below the root (default 8).")
@option("--max-chain", default=None, type=int,
        help="Most drafted tokens verified per target forward (default: 6 on CPU, 8 on GPU). "
             "Chain flags (--max-chain, --min-path-prob) also travel with each request to --target.")
@option("--min-path-prob", type=click.FloatRange(0.0, 1.0), default=None,
        help="Cut chains where the draft's prefix probability falls below this "
        "(default: 0, never).")
@option("--backoff/--no-backoff", default=True, show_default=True,
        help="--inprocess card: pause a draft that keeps missing or makes the target slower "
        "than alone (docs/engine.md); --no-backoff drafts throughout.")
@option("--gamma", default=4, show_default=True, type=int, help="Chain length of --mode sd.")
@option("--chat/--no-chat", default=None, help="Apply the chat template (default: when there is one).")
@option("--target-threads", type=int, default=None, help="torch threads of the target.")
@option("--draft-threads", type=int, default=None, help="torch threads of the draft.")
@option("--json", "as_json", is_flag=True, help="Print one JSON object: text, token_ids, stats.")
@ngram_options("card-client", envvar_prefix="CARD_CLIENT")
@tls_options("card-client", serves=False, envvar_prefix="CARD_CLIENT")
@exits_on_error("card-client")
def generate(prompt: str, inprocess: bool, target_addr: str | None, draft_name: str | None, mode: str,
             target_model: str, draft_model: str, cascade: str, draft_quantize: str | None, dtype: str,
             device: str,
             max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
             stop: tuple[str, ...], ignore_eos: bool, tree_width: int | None, branch: int | None,
             max_depth: int | None, max_chain: int | None, min_path_prob: float | None,
             backoff: bool, gamma: int, chat: bool | None, target_threads: int | None,
             draft_threads: int | None,
             as_json: bool, tls: TlsConfig, ngram: NgramConfig) -> None:
    """Generate text for PROMPT, streaming it as the target commits it; a stats line follows."""
    if draft_quantize is None:
        draft_quantize = DEFAULT_DRAFT.quantize if draft_model == DEFAULT_DRAFT.spec else "none"
    drafter = drafter_of(draft_model, cascade)
    if drafter == "ngram" and cascade != "none":
        raise click.UsageError("--cascade puts n-gram statistics beneath a draft model; --draft-model ngram "
                               "is the statistics alone")
    if drafter != "neural" and mode != "card":
        raise click.UsageError(f"--draft-model ngram and --cascade grow card's trees; --mode {mode} has none")
    draft_shape = tuple(flag for flag, value in (("--tree-width", tree_width), ("--branch", branch),
                                                 ("--max-depth", max_depth)) if value is not None)
    opts = GenerateOptions(
        prompt=prompt,
        mode=mode,
        target=ModelConfig(target_model, dtype, device),
        draft=ModelConfig(draft_model, dtype, device, draft_quantize),
        sampling=SamplingParams(temperature, top_k, top_p, seed),
        stop=StopParams(max_new_tokens, tuple(stop), ignore_eos),
        tree=tree_params(device, drafter, width=tree_width, branch=branch, max_depth=max_depth,
                         max_chain=max_chain, min_path_prob=min_path_prob),
        chain=ChainPolicy(max_chain=max_chain, min_path_prob=min_path_prob),
        draft_shape=draft_shape,
        gamma=gamma,
        backoff=backoff,
        chat=chat,
        target_threads=target_threads,
        draft_threads=draft_threads,
        draft_name=draft_name,
        drafter=drafter,
        ngram=ngram,
    )
    on_text = None if as_json else _echo_text
    if inprocess:
        from client.inprocess import generate_inprocess

        result = generate_inprocess(opts, on_text)
    else:
        from client.services import generate_via_services

        result = generate_via_services(opts, target_addr, on_text, tls)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    else:
        click.echo("")
        click.echo(result.stats.summary(), err=True)


@cli.command()
@click.argument("spec")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
@exits_on_error("card-client")
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
