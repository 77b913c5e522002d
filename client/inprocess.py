"""``generate --inprocess``: both models in this process, no services."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from card.client.options import GenerateOptions
from card.engine.inprocess.runner import InProcessRunner
from card.engine.loading.models import load_model
from card.engine.shared.config import GenerationRequest, Mode
from card.engine.target.generation import GenerationResult


def generate_inprocess(opts: GenerateOptions, on_text: Callable[[str], None] | None) -> GenerationResult:
    config = opts.runner_config()
    _status(f"loading target {opts.target.label} ...")
    target = load_model(opts.target)
    prompt_ids = target.encode_prompt(opts.prompt, opts.chat)  # bad prompts fail before the draft loads
    draft = None
    if config.mode is not Mode.VANILLA and config.drafter.needs_model:
        _status(f"loading draft {opts.draft.label} ...")
        draft = load_model(opts.draft)
    runner = InProcessRunner(target, draft, config)
    try:
        generation = runner.generation(GenerationRequest(
            tuple(prompt_ids), opts.sampling, opts.stop, verify=opts.verify_policy(), logprobs=opts.logprobs))
        for chunk in runner.stream(generation):
            if on_text is not None and chunk.text:
                on_text(chunk.text)
        assert generation.result is not None
        return generation.result
    finally:
        runner.close()


def _status(message: str) -> None:
    if sys.stderr.isatty():
        click.echo(message, err=True)
