"""Where a generation ends, in every mode: EOS (any of the model's EOS ids), stop strings (text cut
before the stop string, tokens cut at the token that completed it, nothing streamed past it),
max_new_tokens and the context window; also when the end falls inside a multi-token commit.

The draft is the target itself, so sd (gamma 4) commits 5 tokens per verification and card
(lockstep 3, chains of 2) commits 3: most ends fall inside a commit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from card.engine.inprocess.sources import SyncDraft
from card.engine.shared.config import StopParams, TreeParams
from card.engine.target.chain_source import NoDraft
from card.engine.target.stopping import OutputTracker
from tests.engine.support import Run, card_source, generate, letters, target_model

MODES = ("vanilla", "sd", "card")
PROMPT = [7, 3, 55, 21, 90, 14, 2, 68]


def two_letters(ids: list[int]) -> str:
    """Two characters per token (``dD`` for 3), so stop strings can start or end mid-token."""
    return "".join(chr(97 + i % 26) + chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    run = generate(target_model("qwen2"), NoDraft(), PROMPT, max_new_tokens=60)
    return run.tokens


@pytest.fixture(scope="module")
def card() -> Iterator:
    with card_source(target_model("qwen2"), TreeParams(width=1, max_depth=5, max_chain=2),
                     lockstep_depth=3) as source:
        yield source


@pytest.fixture(params=MODES)
def run(request: pytest.FixtureRequest, card) -> Callable[..., Run]:
    mode = request.param

    def go(**kwargs) -> Run:
        source = {"vanilla": NoDraft, "sd": lambda: SyncDraft(target_model("qwen2"), 4),
                  "card": lambda: card}[mode]()
        kwargs.setdefault("max_new_tokens", 60)
        out = generate(target_model("qwen2"), source, PROMPT, **kwargs)
        if mode != "vanilla" and len(out.tokens) > 2:
            assert max(out.result.stats.accepted_lengths) > 1, "no multi-token commit happened"
        return out

    go.mode = mode  # type: ignore[attr-defined]
    return go


def cut_inside_commit(out: Run) -> bool:
    """The last verification committed more tokens than the generation kept."""
    return out.result.stats.accepted_lengths[-1] > len(out.chunks[-1].token_ids)


def first_positions(tokens: list[int], count: int, start: int = 1) -> list[int]:
    """Positions (>= start) of tokens that appear there for the first time."""
    found = []
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            found.append(i)
        if len(found) == count:
            break
    return found


# ---- EOS -----------------------------------------------------------------------------------------
def test_every_eos_id_ends_the_generation(run, reference) -> None:
    positions = first_positions(reference, 3, start=4)
    eos = [reference[p] for p in positions]
    unused = next(t for t in range(97) if t not in reference)
    inside = False
    for k, p in enumerate(positions):
        ids = frozenset([*eos[k:], unused])  # eos[k] is the first of these to appear
        out = run(eos_ids=ids, ignore_eos=False)
        assert out.tokens == reference[: p + 1], f"eos ids {sorted(ids)}"
        assert out.result.finish_reason == "eos"
        inside |= cut_inside_commit(out)
    if run.mode != "vanilla":
        assert inside, "no EOS fell inside a multi-token commit"


def test_eos_as_first_token_and_ignore_eos(run, reference) -> None:
    out = run(eos_ids=frozenset({reference[0]}), ignore_eos=False)
    assert out.tokens == reference[:1] and out.result.finish_reason == "eos"
    out = run(eos_ids=frozenset(reference[:5]), ignore_eos=True, max_new_tokens=20)
    assert out.tokens == reference[:20] and out.result.finish_reason == "length"


# ---- stop strings --------------------------------------------------------------------------------
def test_stop_strings_of_one_and_several_tokens(run, reference) -> None:
    text = letters(reference)
    inside = False
    for start, length in [(3, 1), (6, 2), (11, 3), (17, 4)]:
        stop = text[start : start + length]
        first = text.find(stop)  # the first occurrence is where it must end
        out = run(stop=(stop,))
        assert out.result.finish_reason == "stop"
        assert out.result.text == text[:first], f"stop {stop!r}"
        assert out.tokens == reference[: first + length], "tokens end at the one completing the stop"
        inside |= cut_inside_commit(out)
    if run.mode != "vanilla":
        assert inside, "no stop string was completed inside a multi-token commit"


def test_stop_string_starting_and_ending_mid_token(run, reference) -> None:
    text = two_letters(reference)
    for j in (2, 9, 15):
        stop = text[2 * j + 1 : 2 * j + 4]  # upper half of token j .. lower half of token j + 2
        first = text.find(stop)
        out = run(stop=(stop,), decode=two_letters)
        assert out.result.text == text[:first]
        # completed by the token holding the stop string's last character
        assert out.tokens == reference[: (first + len(stop) - 1) // 2 + 1]
        assert out.result.finish_reason == "stop"


def test_earliest_of_several_stop_strings_wins(run, reference) -> None:
    text = letters(reference)
    late, early = text[20:23], text[9:11]
    first = text.find(early)
    if text.find(late) < first:
        pytest.skip("the reference text repeats itself; pick other spans")
    out = run(stop=(late, early))
    assert out.result.text == text[:first] and out.tokens == reference[: first + 2]


def test_absent_stop_string_runs_to_the_budget_and_streams_everything(run, reference) -> None:
    text = letters(reference)
    absent = next(a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"
                  if a + b not in text)
    out = run(stop=(absent,), max_new_tokens=40)
    assert out.result.finish_reason == "length"
    assert out.tokens == reference[:40] and out.result.text == text[:40]


# ---- budgets -------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 2, 3, 7, 13])
def test_max_new_tokens_cuts_at_exactly_the_budget(run, reference, budget: int) -> None:
    out = run(max_new_tokens=budget)
    assert out.tokens == reference[:budget] and out.result.finish_reason == "length"
    # chains are shortened to the room left: the target never commits past the budget
    assert sum(out.result.stats.accepted_lengths) == budget


@pytest.mark.parametrize("window", [len(PROMPT) + 1, len(PROMPT) + 9])
def test_context_window_ends_the_generation(run, reference, window: int) -> None:
    out = run(context_window=window)
    assert out.tokens == reference[: window - len(PROMPT)] and out.result.finish_reason == "length"


# ---- streaming with a real byte-level tokenizer --------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_decode() -> Callable[[list[int]], str]:
    from transformers import AutoTokenizer

    from tests.tiny_models import SMOLLM2_DIR

    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip(f"the SmolLM2 tokenizer is not in {SMOLLM2_DIR} (../shared beside the checkout)")
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    decode.encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[attr-defined]
    return decode


@pytest.mark.parametrize("burst", [1, 4])
def test_stream_never_passes_a_stop_string_next_to_split_characters(smollm2_decode, burst: int) -> None:
    """Emoji and CJK characters span several byte-level tokens; a partial one decodes to U+FFFD.
    For every stop string of 1-4 characters in the text, the stream ends exactly before its first
    occurrence, holds back undecided text, and never shows a replacement character."""
    ids = smollm2_decode.encode("Héllo wörld 🎉🐍 naïve café — 東京 end. ✓✓ ok")
    full = smollm2_decode(ids)
    assert any(smollm2_decode(ids[:i]).endswith("\ufffd") for i in range(len(ids))), "no split character"
    for start in range(len(full)):
        for length in range(1, 5):
            stop = full[start : start + length]
            if len(stop) < length or not stop.strip():
                continue
            params = StopParams(max_new_tokens=1000, stop=(stop,))
            tracker = OutputTracker(params, frozenset(), smollm2_decode)
            streamed = ""
            for i in range(0, len(ids), burst):
                _, delta = tracker.feed(ids[i : i + burst])
                assert "\ufffd" not in delta
                streamed += delta
                if tracker.done:
                    break
            assert tracker.finish_reason == "stop"
            assert streamed == tracker.text == full[: full.find(stop)], f"stop {stop!r}"
