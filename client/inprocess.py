"""``generate --inprocess``: both models in this process, no services."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from client.options import GenerateOptions
from engine.config import GenerationRequest
from engine.generate import GenerationResult
from engine.loading.models import load_model
from engine.runner import InProcessRunner, check_compatible


def generate_inprocess(opts: GenerateOptions, on_text: Callable[[str], None] | None) -> GenerationResult:
    config = opts.runner_config()
    _status(f"loading target {opts.target.label} ...")
    target = load_model(opts.target)
    prompt_ids = target.encode_prompt(opts.prompt, opts.chat)  # bad prompts fail before the draft loads
    draft = None
    if config.mode != "vanilla" and config.drafter != "ngram":
        _status(f"loading draft {opts.draft.label} ...")
        draft = load_model(opts.draft)
        check_compatible(target, draft)
    runner = InProcessRunner(target, draft, config)
    try:
        generation = runner.generation(GenerationRequest(tuple(prompt_ids), opts.sampling, opts.stop))
        for chunk in generation:
            if on_text is not None and chunk.text:
                on_text(chunk.text)
        assert generation.result is not None
        return generation.result
    finally:
        runner.close()


def _status(message: str) -> None:
    if sys.stderr.isatty():
        click.echo(message, err=True)
