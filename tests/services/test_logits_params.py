"""The logits processors' parameters at the edges: across the wire (card.v1 SamplingParams, float32
values read back as typed), through the one validation (the vocabulary, the token budget, the
bounds), and from an HTTP body and a gRPC request with the same content to the same request. The
end-to-end check with the ``openai`` client is in test_openai_api.py (it shares that trio)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from card.common.convert import sampling_from_msg, sampling_to_msg
from card.engine.loading.models import LoadedModel, ModelConfig, load_model
from card.engine.shared.config import ChainPolicy, SamplingParams
from card.engine.shared.errors import InvalidArgument
from card.target_service.config import TargetConfig
from card.target_service.openai_schemas import ChatBody, CompletionBody
from card.target_service.servicer import valid_request
from card.target_service.validation import Validator
from card.v1 import common_pb2, target_pb2
from tests.tiny_models import save_tiny_checkpoint

PROCESSED = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3, min_p=0.05, repetition_penalty=1.1,
                           presence_penalty=-0.3, frequency_penalty=0.7, logit_bias=((5, -100.0), (42, 2.5)),
                           min_tokens=3)


def test_every_field_crosses_the_wire_as_typed() -> None:
    assert sampling_from_msg(sampling_to_msg(PROCESSED)) == PROCESSED
    assert sampling_from_msg(common_pb2.SamplingParams()) == SamplingParams()  # unset: off
    msg = sampling_to_msg(PROCESSED)
    msg.ClearField("repetition_penalty")
    assert sampling_from_msg(msg).repetition_penalty == 1.0


@pytest.mark.parametrize(("fields", "error"), [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),  # set to 0: refused, not taken as 1
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2]"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"min_tokens": -1}, "min_tokens must be >= 0"),
    ({"logit_bias": {7: 101.0}}, "biases must be in [-100, 100]"),
    ({"logit_bias": {-7: 1.0}}, "token ids must be >= 0"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "at most 300 entries, got 301"),
])
def test_bad_values_from_the_wire_are_refused(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        sampling_from_msg(common_pb2.SamplingParams(temperature=0.5, **fields))
    assert error in str(err.value)


# ---- the one validation --------------------------------------------------------------------------
WINDOW = 480


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = save_tiny_checkpoint(Path(tmp_path_factory.mktemp("target")) / "target", dtype=torch.float32)
    return load_model(ModelConfig(spec=str(path), device="cpu"))


@pytest.fixture(scope="module")
def validator(model: LoadedModel) -> Validator:
    return Validator(model, WINDOW, TargetConfig(model=ModelConfig("default")))


def test_the_vocabulary_and_the_budget_bound_logit_bias_and_min_tokens(validator: Validator) -> None:
    def validate(sampling: SamplingParams, max_new_tokens: int | None = None) -> Any:
        return validator.validate([5, 6], sampling=sampling, chain=ChainPolicy(),
                                  max_new_tokens=max_new_tokens)

    vocab = validator.vocab_size
    assert validate(SamplingParams(logit_bias=((vocab - 1, 1.0),))).generation.sampling.logit_bias
    with pytest.raises(InvalidArgument, match=f"logit_bias holds 1 token id\\(s\\) outside the vocabulary "
                                              f"\\[0, {vocab}\\), e.g. {vocab}"):
        validate(SamplingParams(logit_bias=((vocab, 1.0), (3, 1.0))))
    assert validate(SamplingParams(min_tokens=8), max_new_tokens=8).generation.sampling.min_tokens == 8
    with pytest.raises(InvalidArgument, match="min_tokens \\(9\\) must be at most the token budget \\(8\\)"):
        validate(SamplingParams(min_tokens=9), max_new_tokens=8)
    # no budget given: the server's (or the context's end) just ends the generation sooner
    assert validate(SamplingParams(min_tokens=10_000)).generation.sampling.min_tokens == 10_000


def test_http_and_grpc_with_the_same_processors_are_the_same_request(validator: Validator,
                                                                     model: LoadedModel) -> None:
    wire = target_pb2.GenerateRequest(prompt="Once upon a time", chat=target_pb2.CHAT_OFF, max_new_tokens=7,
                                      sampling=sampling_to_msg(PROCESSED))
    body = CompletionBody(model=model.name, prompt="Once upon a time", max_tokens=7, temperature=0.7,
                          top_k=40, top_p=0.9, seed=3, min_p=0.05, repetition_penalty=1.1,
                          presence_penalty=-0.3, frequency_penalty=0.7, logit_bias={"42": 2.5, "5": -100},
                          min_tokens=3)
    from_http = body.valid(validator)
    assert valid_request(wire, validator) == from_http
    assert from_http.generation.sampling == PROCESSED
    # negative control: one processor apart, and they differ
    other = body.model_copy(update={"frequency_penalty": 0.6})
    assert other.valid(validator) != from_http
    # unset: vLLM's defaults, which change nothing
    plain = CompletionBody(model=model.name, prompt="x", max_tokens=2).valid(validator).generation.sampling
    assert not plain.adjusts_logits and plain.min_p == 0.0


@pytest.mark.parametrize(("fields", "error"), [
    ({"logit_bias": {"x": 1.0}}, "logit_bias: keys must be token ids"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "at most 300 entries, got 301"),
    ({"logit_bias": {"49152": 1.0}}, "outside the vocabulary"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
    ({"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens (5) must be at most the token budget (4)"),
])
def test_http_bodies_with_bad_processors_get_one_clear_error(validator: Validator, model: LoadedModel,
                                                            fields: dict[str, Any], error: str) -> None:
    body = ChatBody(model=model.name, messages=[{"role": "user", "content": "x"}], **fields)
    with pytest.raises(InvalidArgument) as err:
        body.valid(validator)
    assert error in str(err.value)
