"""Limits of one request's values, checked where the engine's request types are built (so every
front, gRPC and HTTP, refuses alike with INVALID_ARGUMENT / 400, before any work): stop strings,
temperatures, and chat templates that refuse a conversation."""

from __future__ import annotations

import grpc
import pytest
import torch

from card.common.status import http_status, status_code
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    SAMPLING_EPS,
    ChainPolicy,
    SamplingParams,
    StopParams,
)
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.sampling import filtered_probs, select_token


def refused(err: pytest.ExceptionInfo[InvalidArgument]) -> str:
    """The message of a refusal, checked to be one line that the fronts answer as a bad request."""
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    assert status_code(err.value) == grpc.StatusCode.INVALID_ARGUMENT and http_status(err.value) == 400
    return message


# ---- stop strings --------------------------------------------------------------------------------
def test_the_stop_limits_are_sixteen_strings_of_256_characters() -> None:
    assert (MAX_STOP_STRINGS, MAX_STOP_CHARS) == (16, 256)


def test_sixteen_stop_strings_of_the_longest_length_are_accepted() -> None:
    stops = tuple(f"{k:02d}" + "x" * (MAX_STOP_CHARS - 2) for k in range(MAX_STOP_STRINGS))
    assert StopParams(8, stop=stops).stop == stops
    assert StopParams(8, stop=["a", "b"]).stop == ("a", "b")  # any sequence, kept as a tuple
    assert StopParams(8, stop="</s>").stop == ("</s>",)  # one string is one stop string


def test_a_seventeenth_stop_string_is_refused() -> None:
    with pytest.raises(InvalidArgument) as err:
        StopParams(8, stop=tuple(str(k) for k in range(MAX_STOP_STRINGS + 1)))
    assert refused(err) == "stop: at most 16 strings of at most 256 characters each; got 17"


def test_the_probe_of_200000_stop_strings_is_refused() -> None:
    """The issue's probe: one gRPC request with 200,000 two-character stop strings."""
    with pytest.raises(InvalidArgument) as err:
        StopParams(48, stop=["ab"] * 200_000)
    assert refused(err).endswith("got 200000")


def test_a_stop_string_of_257_characters_is_refused() -> None:
    with pytest.raises(InvalidArgument) as err:
        StopParams(8, stop=("ok", "y" * (MAX_STOP_CHARS + 1)))
    assert refused(err).endswith(f"got one of {MAX_STOP_CHARS + 1} characters")


@pytest.mark.parametrize("stop", [("",), ("a", ""), ("ab", 3)], ids=["empty", "one-empty", "not-a-string"])
def test_empty_and_non_string_stop_strings_are_refused(stop: tuple) -> None:
    with pytest.raises(InvalidArgument) as err:
        StopParams(8, stop=stop)
    assert refused(err).startswith("stop")


def test_the_target_front_refuses_too_many_stop_strings_before_any_work() -> None:
    """The gRPC servicer and the HTTP front build their request with Validator.validate, which builds
    StopParams: no generation is made of a refused request."""
    from card.engine.loading.models import ModelConfig
    from card.target_service.config import TargetConfig
    from card.target_service.validation import Validator

    model = LoadedModel("tiny", torch.nn.Linear(1, 1), None, "", frozenset(), 64)
    validator = Validator(model, 64, TargetConfig(model=ModelConfig("default")))
    request = validator.validate([1, 2, 3], sampling=SamplingParams(), chain=ChainPolicy(), max_new_tokens=8,
                                 stop=["ab"] * MAX_STOP_STRINGS).generation
    assert request.stop.stop == ("ab",) * MAX_STOP_STRINGS
    with pytest.raises(InvalidArgument) as err:
        validator.validate([1, 2, 3], sampling=SamplingParams(), chain=ChainPolicy(), max_new_tokens=8,
                           stop=["ab"] * 200_000)
    assert refused(err).endswith("got 200000")


# ---- temperatures --------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-320, 1e-300, SAMPLING_EPS / 2])
def test_temperatures_below_the_epsilon_are_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.greedy
    logits = torch.tensor([1.0, 7.5, -2.0, 7.25, float("-inf")])
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all() and probs.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert all(select_token(logits, p, params) == 1 for p in range(20))


@pytest.mark.parametrize("temperature", [SAMPLING_EPS, 1e-3, 1.0, MAX_TEMPERATURE])
def test_temperatures_from_the_epsilon_to_the_maximum_sample_finite_probabilities(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_k=3, top_p=0.9)
    assert not params.greedy
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 30
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-12


@pytest.mark.parametrize("temperature", [1e300, MAX_TEMPERATURE * 1.01, float("inf"), float("nan"), -1e-9,
                                         float("-inf")])
def test_huge_negative_and_non_finite_temperatures_are_refused(temperature: float) -> None:
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(temperature=temperature)
    assert refused(err).startswith("temperature must be a number in [0, 100]")


@pytest.mark.parametrize("top_p", [float("nan"), float("inf"), 0.0, 1.5])
def test_non_finite_top_p_is_refused(top_p: float) -> None:
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(temperature=1.0, top_p=top_p)
    refused(err)


# ---- chat templates that refuse a conversation ---------------------------------------------------
ALTERNATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
)


def chat_model(template: str) -> LoadedModel:
    """A LoadedModel whose tokenizer (a word-level one, built in code) has ``template``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "user", "assistant", "hi", "there", "again"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tokenizer.chat_template = template
    return LoadedModel("tiny-chat", torch.nn.Linear(1, 1), tokenizer, "", frozenset(), 64)


def test_a_conversation_the_template_accepts_is_encoded() -> None:
    model = chat_model(ALTERNATE)
    ids = model.encode_prompt([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"},
                               {"role": "user", "content": "again"}])
    assert ids == [1, 3, 2, 4, 1, 5]


def test_a_template_raising_exception_is_one_invalid_argument() -> None:
    """``raise_exception`` (jinja2's TemplateError): the template's own message, on one line,
    with no exception chained to it (nothing for a log to print a traceback of)."""
    model = chat_model(ALTERNATE)
    with pytest.raises(InvalidArgument) as err:
        model.encode_prompt([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}])
    message = refused(err)
    assert message.endswith("Conversation roles must alternate user/assistant/user/assistant/...")
    assert message.startswith("the chat template of tiny-chat refused the conversation")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(InvalidArgument):  # a single assistant message, text through chat=True too
        model.encode_prompt([{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize(("template", "words"), [
    ("{{ raise_exception('line one\nline two') }}", "line one line two"),
    ("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}", "TypeError"),
    ("{{ messages[0]['content'] | no_such_filter }}", "no_such_filter"),
], ids=["multi-line", "type-error", "unknown-filter"])
def test_other_template_failures_are_one_line_invalid_arguments(template: str, words: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        chat_model(template).encode_prompt("hi", chat=True)
    assert words in refused(err)
