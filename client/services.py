"""``generate`` through the gRPC services: a configured target, or a local trio for one command."""

from __future__ import annotations

from collections.abc import Callable

import click

from client.options import GenerateOptions
from client.remote import generate_remote
from client.trio import LocalTrio
from engine.errors import InvalidArgument
from engine.generate import GenerationResult


def generate_via_services(opts: GenerateOptions, target_addr: str | None,
                          on_text: Callable[[str], None] | None) -> GenerationResult:
    """Use the target at ``target_addr`` (an error if it is unreachable); with none configured,
    start a local trio (redis-server, card-cache, card-draft, card-target) for this command."""
    if target_addr:
        return _remote(opts, target_addr, on_text)
    click.echo(
        "no card-target configured (--target / CARD_TARGET_ADDR): starting a local trio for this "
        "command; `card-client up` keeps one running",
        err=True,
    )
    with LocalTrio(
        target_model=opts.target.spec,
        draft_model=opts.draft.spec,
        draft_quantize=opts.draft.quantize,
        target_threads=opts.target_threads,
        draft_threads=opts.draft_threads,
        draft_name=opts.draft_name,
        dtype=opts.target.dtype,
        device=opts.target.device,
        extra_args={"draft": ["--tree-width", str(opts.tree.width), "--max-depth", str(opts.tree.max_depth)]},
    ) as trio:
        return _remote(opts, trio.target_addr, on_text)


def _remote(opts: GenerateOptions, addr: str, on_text: Callable[[str], None] | None) -> GenerationResult:
    if opts.mode == "sd":
        raise InvalidArgument("--mode sd (classic draft-then-verify) runs in-process only: add --inprocess")
    return generate_remote(
        addr,
        opts.prompt,
        chat=opts.chat,
        sampling=opts.sampling,
        stop=opts.stop,
        draft=opts.draft_name,
        mode="vanilla" if opts.mode == "vanilla" else "card",
        on_text=on_text,
    )
