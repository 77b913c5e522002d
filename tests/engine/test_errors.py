"""Bad input at the engine level gets a domain error with a message a person can act on
(DESIGN.md §7): InvalidArgument, NotFound, FailedPrecondition. (CLI-level tests are elsewhere.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig, check_compatible
from card.engine.loading.fingerprint import tokenizer_fingerprint
from card.engine.loading.models import LoadedModel, ModelConfig, load_model, load_tokenizer
from card.engine.shared.config import GenerationRequest, Mode, SamplingParams, StopParams, TreeParams
from card.engine.shared.errors import (
    Aborted,
    CardError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation, check_prompt
from tests.engine.support import letters
from tests.tiny_models import save_foreign_tokenizer_checkpoint, save_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, LoadedModel, LoadedModel]:
    """(target, a draft with the same tokenizer, a draft whose tokenizer has one extra token),
    tiny weights with the SmolLM2 tokenizer, loaded through load_model like any checkpoint."""
    root = tmp_path_factory.mktemp("models")
    load = lambda path: load_model(ModelConfig(spec=str(path), dtype="float64", device="cpu"))  # noqa: E731
    return (load(save_tiny_checkpoint(root / "target", dtype=torch.float64)),
            load(save_tiny_checkpoint(root / "draft", seed=1, dtype=torch.float64)),
            load(save_foreign_tokenizer_checkpoint(root / "foreign", seed=1)))


def test_error_codes_name_grpc_codes() -> None:
    assert [e.code for e in (InvalidArgument, NotFound, FailedPrecondition, Aborted,
                             ResourceExhausted, Unavailable)] == [
        "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ABORTED", "RESOURCE_EXHAUSTED",
        "UNAVAILABLE"]
    assert issubclass(InvalidArgument, CardError) and CardError.code == "INTERNAL"


# ---- prompts -------------------------------------------------------------------------------------
def test_empty_prompt(models) -> None:
    target, _, _ = models
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        Generation(GenerationRequest(()), NoDraft(), eos_ids=frozenset(),
                   decode=letters, context_window=512, mode="vanilla")
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA)).generation(GenerationRequest(()))
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        target.encode_prompt("", chat=False)


def test_prompt_longer_than_the_context_window(models) -> None:
    target, _, _ = models
    window = target.context_window
    runner = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA))
    for length in (window, window + 100):
        with pytest.raises(InvalidArgument) as info:
            runner.generation(GenerationRequest(tuple([5] * length)))
        message = str(info.value)
        assert f"{length} tokens" in message and f"{window} tokens" in message and target.name in message
    # one token of room is enough
    result = runner.run(GenerationRequest(tuple([5] * (window - 1))))
    assert len(result.token_ids) == 1 and result.finish_reason == "length"


def test_check_prompt_names_the_model() -> None:
    with pytest.raises(InvalidArgument, match="context window of big-model is 8 tokens"):
        check_prompt(list(range(9)), 8, "big-model")
    check_prompt(list(range(7)), 8, "big-model")


# ---- tokenizers ----------------------------------------------------------------------------------
def test_draft_with_another_tokenizer_is_refused_naming_both_models(models) -> None:
    target, draft, foreign = models
    check_compatible(target, draft)
    assert foreign.fingerprint != target.fingerprint
    with pytest.raises(FailedPrecondition) as info:
        check_compatible(target, foreign)
    message = str(info.value)
    assert target.name in message and foreign.name in message
    assert target.fingerprint in message and foreign.fingerprint in message
    for mode in ("card", "sd"):
        with pytest.raises(FailedPrecondition):
            InProcessRunner(target, foreign, RunnerConfig(mode=Mode(mode)))


def test_tiny_checkpoint_shares_smollm2_fingerprint(models, smollm2_gguf) -> None:
    """The tiny checkpoints carry the real SmolLM2 tokenizer, so the mismatch above is the added
    token and nothing else."""
    target, _, _ = models
    assert target.fingerprint == tokenizer_fingerprint(load_tokenizer(str(smollm2_gguf)))


def test_modes_need_a_draft(models) -> None:
    target, _, _ = models
    with pytest.raises(InvalidArgument, match="needs a draft"):
        InProcessRunner(target, None, RunnerConfig(mode=Mode.CARD))


# ---- model specs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["/nonexistent/model-dir", "./missing-model.gguf", "~/no/such/model"])
def test_unknown_model_path(spec: str) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        load_model(ModelConfig(spec=spec))


def test_folder_without_a_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no weights here")
    with pytest.raises(NotFound, match=r"neither a transformers checkpoint nor a \.gguf"):
        load_model(ModelConfig(spec=str(tmp_path)))


@pytest.mark.parametrize(
    "kwargs", [{"spec": ""}, {"dtype": "float8"}, {"quantize": "int4"}, {"device": "tpu"}],
    ids=lambda kw: next(iter(kw)),
)
def test_bad_model_config(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        ModelConfig(**kwargs)


# ---- parameters ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
     ({"temperature": math.inf}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"top_p": -0.2}, "top_p"), ({"seed": -3}, "seed")],
)
def test_bad_sampling_values(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"max_new_tokens": -5}, {"stop": ("ok", "")}])
def test_bad_stop_values(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        StopParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"width": 0}, {"width": 65}, {"branch": -1}, {"max_depth": 0},
                                    {"max_chain": -1}])
def test_bad_tree_values(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        TreeParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"mode": "turbo"}, {"gamma": 0}])
def test_bad_runner_values(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        RunnerConfig(**kwargs)


def test_good_values_are_accepted() -> None:
    """The edges of every valid range are kept as given (and greedy is exactly temperature 0)."""
    assert SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0).greedy
    hot = SamplingParams(temperature=2.0, top_k=50, top_p=0.01, seed=2**40)
    assert not hot.greedy and (hot.top_k, hot.top_p, hot.seed) == (50, 0.01, 2**40)
    assert StopParams(max_new_tokens=1, stop=("\n",)).stop == ("\n",)
    tree = TreeParams(width=64, branch=64, max_depth=1, max_chain=0)
    assert (tree.width, tree.k, tree.max_depth, tree.max_chain) == (64, 64, 1, 0)
    assert TreeParams(width=3, branch=0).k == 3  # branch 0 = width
