"""Helpers of the end-to-end tests: a reference (in-process vanilla) and metric scraping."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.models import LoadedModel, ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, Mode, SamplingParams, StopParams
from card.engine.target.generation import GenerationResult

Reference = Callable[[str | Sequence[int], SamplingParams, StopParams], GenerationResult]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the reference with the target process's thread count (same reduction order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def vanilla_reference(model: LoadedModel) -> Reference:
    """In-process plain decoding of the target model: what every trio output must equal."""
    runner = InProcessRunner(model, None, RunnerConfig(mode=Mode.VANILLA))

    def run(prompt: str | Sequence[int], sampling: SamplingParams, stop: StopParams) -> GenerationResult:
        ids = model.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        return runner.run(GenerationRequest(tuple(ids), sampling, stop))

    return run


def float64_reference(checkpoint: str | Path, threads: int = 1) -> Reference:
    """``vanilla_reference`` of a tiny float64 checkpoint, run on ``threads`` threads (the
    target process's count in the trio tests)."""
    run = vanilla_reference(load_model(ModelConfig(str(checkpoint), dtype="float64", exact=True)))

    def on_threads(*args):
        with torch_threads(threads):
            return run(*args)

    return on_threads


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in a Prometheus text page."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"metric {name} not found"
    return float(match.group(1))


def labelled(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name{labels}`` in a Prometheus text page (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_until(check: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.1)
