"""``generate`` through the gRPC services: a configured target, or a local trio for one command."""

from __future__ import annotations

from collections.abc import Callable

import click

from card.client.options import GenerateOptions
from card.client.remote import DEFAULT_TIMEOUT_S, generate_remote
from card.client.trio import LocalTrio
from card.common.convert import verify_to_msg
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.config import Mode
from card.engine.shared.errors import InvalidArgument
from card.engine.target.generation import GenerationResult


def generate_via_services(opts: GenerateOptions, target_addr: str | None,
                          on_text: Callable[[str], None] | None,
                          tls: TlsConfig = PLAINTEXT, api_key: str | None = None,
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> GenerationResult:
    """Use the target at ``target_addr`` (an error if it is unreachable); with none configured,
    start a local trio (redis-server, card-cache, card-draft, card-target) for this command.

    Every tree flag reaches the services: a local trio is started with all of them
    (``card.client.trio.service_args``); a running target gets the chain flags with the request, and
    the draft-shape flags, which only the running draft worker could honour, are refused. ``tls``
    and ``api_key``: how to dial the running target (a local trio is loopback plaintext, keyless);
    ``timeout_s``: the generation's deadline (``generate --timeout``)."""
    if target_addr:
        if opts.draft_shape:
            raise InvalidArgument(
                f"{', '.join(opts.draft_shape)} shape(s) the draft worker's tree and cannot travel with a "
                f"request to --target {target_addr}; set it where card-draft runs (card-draft "
                f"{opts.draft_shape[0]} N), or drop --target to start a local trio")
        return _remote(opts, target_addr, on_text, tls, api_key, timeout_s)
    click.echo(
        "no card-target configured (--target / CARD_CLIENT_TARGET_ADDR): starting a local trio for this "
        "command; `card-client up` keeps one running",
        err=True,
    )
    with LocalTrio(
        target_model=opts.target.spec,
        draft_model=opts.draft.spec,
        draft_quantize=opts.draft.quantize,
        cascade=opts.drafter.cascade,
        ngram=opts.ngram if opts.drafter.uses_ngram else None,
        target_threads=opts.target_threads,
        draft_threads=opts.draft_threads,
        draft_name=opts.draft_name,
        dtype=opts.target.dtype,
        device=opts.target.device,
        tree=opts.tree,
        exact=opts.target.exact,
        extra_args={"target": ["--allow-rejection"]},  # its own draft: verify rejection as asked
    ) as trio:
        return _remote(opts, trio.target_addr, on_text, timeout_s=timeout_s)


def _remote(opts: GenerateOptions, addr: str, on_text: Callable[[str], None] | None,
            tls: TlsConfig = PLAINTEXT, api_key: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> GenerationResult:
    if opts.mode is Mode.SD:
        raise InvalidArgument("--mode sd (classic draft-then-verify) runs in-process only: add --inprocess")
    return generate_remote(
        addr,
        opts.prompt,
        chat=opts.chat,
        sampling=opts.sampling,
        stop=opts.stop,
        draft=opts.draft_name,
        mode=opts.mode.value,
        chain=opts.chain,
        on_text=on_text,
        tls=tls,
        api_key=api_key,
        verify=verify_to_msg(opts.verify, opts.loose_entropy_threshold, opts.loose_window),
        logprobs=opts.logprobs,
        timeout_s=timeout_s,
    )
