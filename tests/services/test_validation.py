"""The one validation of card-target's fronts (card.target_service.validation): every bad input
gets its one clear error from ``Validator.validate``, and a gRPC GenerateRequest and an HTTP body
with the same content become equal ``ValidRequest``s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from card.common.tensors import ids_to_msg
from card.engine.loading.models import LoadedModel, ModelConfig, load_model
from card.engine.shared.config import ChainPolicy, SamplingParams
from card.engine.shared.errors import InvalidArgument, NotFound
from card.target_service.config import TargetConfig
from card.target_service.openai_schemas import ChatBody, CompletionBody
from card.target_service.servicer import valid_request
from card.target_service.validation import Validator, ValidRequest
from card.v1 import common_pb2, target_pb2
from tests.tiny_models import save_tiny_checkpoint

WINDOW = 480  # tokens a request may hold here (--max-model-len), below the model's 512


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = save_tiny_checkpoint(Path(tmp_path_factory.mktemp("target")) / "target", dtype=torch.float32)
    return load_model(ModelConfig(spec=str(path), device="cpu"))


@pytest.fixture(scope="module")
def validator(model: LoadedModel) -> Validator:
    return Validator(model, WINDOW, TargetConfig(model=ModelConfig("default"), allow_loose=False))


def validate(validator: Validator, prompt: Any = "Hello", **fields: Any) -> ValidRequest:
    fields.setdefault("sampling", SamplingParams())
    fields.setdefault("chain", ChainPolicy())
    return validator.validate(prompt, **fields)


@pytest.mark.parametrize(("prompt", "fields", "error"), [
    ("Hello", {"mode": "sd"}, "mode must be one of card, card-auto, vanilla, got 'sd'"),
    ("Hello", {"verify": "fuzzy"}, "verify must be one of exact, loose, rejection, got 'fuzzy'"),
    ("Hello", {"verify": "loose"}, "verify loose (lossy) is not allowed on this server (--no-allow-loose)"),
    ("Hello", {"verify": "exact", "window": 1}, "the loose window must be in [2, 64] tokens, got 1"),
    ("Hello", {"max_new_tokens": 0}, "the token budget must be >= 1, got 0"),
    ("Hello", {"stop": ["x"] * 17}, "stop: at most 16 strings of at most 256 characters each; got 17"),
    ("Hello", {"stop": [""]}, "stop strings must not be empty"),
    ("Hello", {"logprobs": 21}, "logprobs must be in [0, 20] alternatives per token, got 21"),
    ("Hello", {"chain": ChainPolicy(max_chain=-1)}, "max_chain must be in [0, 64], got -1"),
    ("Hello", {"chain": ChainPolicy(max_chain=1_000_000)}, "max_chain must be in [0, 64], got 1000000"),
    ("", {}, "the prompt is empty"),
    ([], {}, "the prompt is empty"),
    ([1, "two", 3], {}, "a prompt is text, a list of messages, or a list of token ids"),
    ([1, True], {}, "a prompt is text, a list of messages, or a list of token ids"),
    ([1, 49152], {}, "the prompt holds 1 token id(s) outside the vocabulary [0, 49152), e.g. 49152"),
    ([1, -1], {}, "outside the vocabulary"),
    ([5] * WINDOW, {}, f"the prompt has {WINDOW} tokens but this card-target holds {WINDOW} tokens per "
                       "request (--max-model-len; the context window of"),
    ("1" * 600, {"chat": False}, f"the prompt has 600 tokens but this card-target holds {WINDOW}"),
])
def test_every_bad_input_gets_its_one_clear_error(validator: Validator, prompt: Any, fields: dict,
                                                 error: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate(validator, prompt, **fields)
    assert error in str(err.value)


def test_a_text_past_any_tokenization_is_refused_by_its_characters(validator: Validator) -> None:
    """No token covers more than twice the longest vocabulary piece's characters, whitespace aside: a
    text longer than the context by that measure is refused before it is tokenized (the message
    counts characters)."""
    chars = 2 * validator.token_chars * WINDOW
    assert validator.token_chars > 1
    for prompt in ["a" * chars, [{"role": "user", "content": "a" * chars}]]:
        with pytest.raises(InvalidArgument, match=f"the prompt has {chars} characters "
                                                  f"\\(at least {WINDOW} tokens\\) but this card-target"):
            validate(validator, prompt)
    # a text the characters cannot rule out is tokenized, and its tokens are counted (a digit each);
    # whitespace, which a normalizer may collapse, does not count as characters
    for text in ["1" * (chars - 2 * validator.token_chars), "1 " * (chars - 2 * validator.token_chars)]:
        with pytest.raises(InvalidArgument, match="tokens but this card-target holds"):
            validate(validator, text, chat=False)


def test_the_budget_is_the_rest_of_the_context_within_the_cap(validator: Validator,
                                                              model: LoadedModel) -> None:
    assert validate(validator, [5] * 10).generation.stop.max_new_tokens == WINDOW - 10  # none: vLLM's rule
    assert validate(validator, [5] * 10, max_new_tokens=7).generation.stop.max_new_tokens == 7
    cut = validate(validator, [5] * (WINDOW - 3), max_new_tokens=100).generation
    assert len(cut.prompt_ids) + cut.stop.max_new_tokens == WINDOW
    capped = Validator(model, WINDOW, TargetConfig(model=ModelConfig("default"), max_tokens_cap=50))
    assert validate(capped, [5] * 10).generation.stop.max_new_tokens == 50  # --max-tokens-cap
    assert validate(capped, [5] * 10, max_new_tokens=70).generation.stop.max_new_tokens == 50
    assert validate(capped, [5] * 10, max_new_tokens=20).generation.stop.max_new_tokens == 20
    assert validate(capped, [5] * (WINDOW - 3)).generation.stop.max_new_tokens == 3


def test_loose_takes_the_servers_fly_settings_where_the_request_sets_none(model: LoadedModel) -> None:
    config = TargetConfig(model=ModelConfig("default"), loose_entropy_threshold=0.7, loose_window=9)
    loose = Validator(model, WINDOW, config)
    assert validate(loose, verify="loose").generation.verify.entropy_threshold == 0.7
    assert validate(loose, verify="loose", window=3).generation.verify.window == 3


def same_content(model: LoadedModel) -> list[tuple[target_pb2.GenerateRequest, CompletionBody | ChatBody]]:
    sampling = dict(temperature=0.5, top_k=5, top_p=0.75, seed=3)
    wire_sampling = common_pb2.SamplingParams(**sampling)
    chat_msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    return [
        (target_pb2.GenerateRequest(
            prompt="Once upon a time", chat=target_pb2.CHAT_OFF, sampling=wire_sampling,
            max_new_tokens=7, stop=["\n", "The end"], ignore_eos=True, logprobs=2, mode="card-auto",
            draft="pool-a", verify=target_pb2.VerifyPolicy(mode="rejection")),
         CompletionBody(model=model.name, prompt="Once upon a time", max_tokens=7, stop=["\n", "The end"],
                        ignore_eos=True, logprobs=2, mode="card-auto", draft="pool-a", verify="rejection",
                        **sampling)),
        (target_pb2.GenerateRequest(
            messages=target_pb2.Conversation(messages=[target_pb2.ChatMessage(**m) for m in chat_msgs]),
            sampling=wire_sampling, max_new_tokens=5, stop=["!"], mode="vanilla"),
         ChatBody(model=model.name, messages=[
             {"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
                  max_completion_tokens=5, stop="!", mode="vanilla", **sampling)),
        (target_pb2.GenerateRequest(prompt_ids=ids_to_msg([7, 8, 9]), max_new_tokens=600),  # greedy
         CompletionBody(model=model.name, prompt=[[7, 8, 9]], max_tokens=600, temperature=0)),
    ]


def test_a_grpc_and_an_http_request_with_the_same_content_are_the_same_valid_request(
        validator: Validator, model: LoadedModel) -> None:
    valid = []
    for grpc_request, body in same_content(model):
        from_grpc, from_http = valid_request(grpc_request, validator), body.valid(validator)
        assert from_grpc == from_http
        valid.append(from_grpc)
    text, chat, ids = valid
    assert text.generation.prompt_ids == tuple(model.encode_prompt("Once upon a time", chat=False))
    assert chat.generation.prompt_ids == tuple(model.encode_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], chat=True))
    assert ids.generation.prompt_ids == (7, 8, 9) and ids.generation.stop.max_new_tokens == WINDOW - 3
    # negative control: one field apart, and they differ
    grpc_request, body = same_content(model)[0]
    grpc_request.sampling.seed = 4
    assert valid_request(grpc_request, validator) != body.valid(validator)


def test_http_only_refusals_come_before_the_validation(validator: Validator, model: LoadedModel) -> None:
    with pytest.raises(InvalidArgument, match="echo, suffix: not served by card-target"):
        CompletionBody(model=model.name, prompt="x", echo=True, suffix="y").valid(validator)
    with pytest.raises(NotFound, match="model 'other' is not served here"):
        CompletionBody(model="other", prompt="x").valid(validator)
    with pytest.raises(InvalidArgument, match="one prompt per request"):
        CompletionBody(model=model.name, prompt=["a", "b"]).valid(validator)
    with pytest.raises(InvalidArgument, match="top_logprobs needs logprobs: true"):
        ChatBody(model=model.name, messages=[{"role": "user", "content": "x"}],
                 top_logprobs=2).valid(validator)


def test_rejection_is_verified_exactly_unless_the_server_allows_it(model: LoadedModel) -> None:
    """verify rejection trusts the draft with q (docs/architecture.md, trust model): card-target
    verifies such requests exactly by default (no drawn chains, plain decoding's tokens, stats
    saying exact); with --allow-rejection they get the rule with its q floor and secret coins."""
    from card.engine.shared.config import ChainDraw, Verify, VerifyPolicy

    sampled = SamplingParams(temperature=0.8, seed=3)
    default = Validator(model, WINDOW, TargetConfig(model=ModelConfig("default")))
    got = validate(default, verify="rejection", sampling=sampled).generation
    assert got.verify == VerifyPolicy() and got.chain_draw is None
    allowed = Validator(model, WINDOW, TargetConfig(model=ModelConfig("default"), allow_rejection=True,
                                                    rejection_q_floor=0.02))
    got = validate(allowed, verify="rejection", sampling=sampled).generation
    assert got.verify == VerifyPolicy(Verify.REJECTION, q_floor=0.02, secret_coins=True)
    assert got.chain_draw == ChainDraw(0.8, 3)  # the target's; the cache and draft get their own seed
    assert validate(allowed, verify="exact", sampling=sampled).generation.verify == VerifyPolicy()
    for floor in (-0.1, 1.0, float("nan")):
        with pytest.raises(InvalidArgument, match="rejection q floor"):
            TargetConfig(model=ModelConfig("default"), rejection_q_floor=floor)
