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
def smollm2_decode(smollm2_tokenizer) -> Callable[[list[int]], str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer)
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


# ---- incremental detokenization: exact against the full decode ------------------------------------
def oracle(ids: list[int], params: StopParams,
           decode: Callable[[list[int]], str]) -> tuple[list[int], str, str]:
    """What the tracker must produce, the slow way: the whole text decoded after every token, the
    generation ending at the first token whose text holds a stop string, cut at its first one."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        hits = [i for s in params.stop if (i := text.find(s)) >= 0]
        if hits:
            return ids[:k], text[: min(hits)], "stop"
        if k >= params.max_new_tokens:
            return ids[:k], text, "length"
    return ids, decode(ids), "open"


def track(ids: list[int], params: StopParams, decode: Callable[[list[int]], str],
          bursts: list[int]) -> tuple[OutputTracker, list[int], str]:
    """Feed ``ids`` in bursts of the given sizes (cycled); returns (tracker, kept, streamed)."""
    tracker = OutputTracker(params, frozenset(), decode)
    kept, streamed, i, b = [], "", 0, 0
    while i < len(ids) and not tracker.done:
        burst = ids[i : i + bursts[b % len(bursts)]]
        got, delta = tracker.feed(burst)
        kept += got
        streamed += delta
        i, b = i + len(burst), b + 1
    if not tracker.done:
        streamed += tracker.finish("length")
    return tracker, kept, streamed


@pytest.fixture(scope="module")
def smollm2_pieces(smollm2_decode) -> list[list[int]]:
    """Token runs of real text (multi-byte characters split across byte-level tokens included)."""
    text = "Héllo wörld 🎉🐍 naïve café — 東京 end. ✓✓ ok 😀👍🏽 ünïcödé ∑∫ 中文字符 — stop. STOP"
    return [smollm2_decode.encode(w) for w in text.split(" ")] + [smollm2_decode.encode(" " + w)
                                                                  for w in text.split(" ")]


def test_stream_and_text_equal_the_full_decode_on_random_smollm2_sequences(smollm2_decode,
                                                                            smollm2_pieces) -> None:
    """Random id sequences over the whole vocabulary, over single bytes (split emoji, invalid UTF-8)
    and over real multi-byte text, fed in random bursts, with stop strings from their own text: the
    tokens, the finish reason, the text and the stream equal the whole-text oracle's."""
    import random

    decode = smollm2_decode
    byte_tokens = [i for i in range(256, 49152) if decode([i]) == "\ufffd"][:200]
    byte_tokens += [i for i in range(0, 600) if decode([i]) == "\ufffd"]
    assert len(byte_tokens) > 50
    rng = random.Random(7)
    stops_seen = 0
    for trial in range(160):
        kind = trial % 4
        if kind == 0:
            ids = [rng.randrange(49152) for _ in range(rng.randint(1, 60))]
        elif kind == 1:
            ids = [rng.choice(byte_tokens) for _ in range(rng.randint(1, 60))]
        elif kind == 2:
            ids = [t for _ in range(rng.randint(1, 20)) for t in rng.choice(smollm2_pieces)]
        else:
            ids = [t for _ in range(rng.randint(1, 20))
                   for t in rng.choice([*smollm2_pieces, [rng.choice(byte_tokens)], [0], [2]])]
        full = decode(ids)
        stops: tuple[str, ...] = ()
        if trial % 2 and len(full) > 3:
            a = rng.randrange(len(full) - 1)
            stops = (full[a : a + rng.randint(1, 6)], full[rng.randrange(len(full)):][:3] or "x", "never §")
        params = StopParams(max_new_tokens=rng.randint(len(ids) // 2 + 1, len(ids) + 1), stop=stops)
        bursts = [rng.randint(1, 5) for _ in range(4)]
        tracker, kept, streamed = track(ids, params, decode, bursts)
        want_ids, want_text, why = oracle(ids, params, decode)
        assert kept == tracker.token_ids == want_ids, (trial, ids, stops)
        assert streamed == tracker.text == want_text, (trial, ids, stops)
        assert tracker.finish_reason == ("length" if why == "open" else why)
        stops_seen += why == "stop"
        assert tracker._detok.exact
    assert stops_seen > 20


def sentencepiece_decode() -> Callable[[list[int]], str]:
    """A Llama-2-style tokenizer built in code: SentencePiece pieces (``▁`` for a space, the first
    one's leading space stripped), byte fallback tokens ``<0xNN>`` and special tokens skipped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "▁Hello", "▁world", "Hello", "lo", "▁a", "b", "▁▁", "▁.", ".", "▁東", "京", "!"]:
        vocab[piece] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    decode.vocab = vocab  # type: ignore[attr-defined]
    return decode


def test_stream_equals_the_full_decode_for_a_sentencepiece_tokenizer() -> None:
    """Leading-space stripping and byte-fallback characters (all-or-nothing runs of byte tokens):
    the window keeps enough context that the stream still equals the full decode."""
    import random

    decode = sentencepiece_decode()
    vocab = decode.vocab  # type: ignore[attr-defined]
    pieces = [[i] for p, i in vocab.items() if not p.startswith("<")]
    pieces += [[vocab[f"<0x{b:02X}>"] for b in ch.encode()] for ch in "🎉é東ü✓"] + [[1], [2]]
    rng = random.Random(3)
    for _ in range(200):
        ids = [t for _ in range(rng.randint(1, 30)) for t in rng.choice(pieces)]
        full = decode(ids)
        stop = (full[len(full) // 2 :][:2],) if len(full) > 4 else ()
        params = StopParams(max_new_tokens=len(ids), stop=stop)
        tracker, kept, streamed = track(ids, params, decode, [rng.randint(1, 4)])
        want_ids, want_text, _ = oracle(ids, params, decode)
        assert kept == want_ids and streamed == tracker.text == want_text, ids


# ---- bounded work per token -----------------------------------------------------------------------
class CountingDecode:
    """A decode function that records how many ids each call was given."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.calls = decode, []

    def __call__(self, ids: list[int]) -> str:
        self.calls.append(len(ids))
        return self.decode(list(ids))


class WholeTextTracker:
    """The approach before incremental decoding, as a negative control: decode every id each token."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.ids = decode, []

    def feed(self, tokens: list[int]) -> str:
        self.ids += tokens
        return self.decode(self.ids)


def ids_per_token(make, ids: list[int], decode: Callable[[list[int]], str]) -> list[int]:
    counting = CountingDecode(decode)
    tracker = make(counting)
    per_token = []
    for t in ids:
        before = sum(counting.calls)
        tracker.feed([t])
        per_token.append(sum(counting.calls) - before)
    return per_token


def long_output(smollm2_decode, n: int = 2000) -> list[int]:
    """``n`` tokens of text with emoji, CJK and a few invalid bytes among them."""
    text = "The 🎉 party in 東京 was naïve — ünïcödé ✓ and 😀👍🏽 happened again. " * 80
    ids = smollm2_decode.encode(text)[:n]
    for i in range(100, n, 300):  # a lone continuation byte, invalid UTF-8 that stays U+FFFD
        ids[i] = next(t for t in range(600) if smollm2_decode([t]) == "\ufffd")
    assert len(ids) == n
    return ids


def test_decode_work_per_token_is_bounded_independently_of_the_output_length(smollm2_decode) -> None:
    ids = long_output(smollm2_decode)
    params = StopParams(max_new_tokens=10_000, stop=("never seen §",))
    work = ids_per_token(lambda d: OutputTracker(params, frozenset(), d), ids, smollm2_decode)
    # a window of recent tokens, whatever the position: the last 500 tokens cost what the first did
    assert max(work) <= 40 and max(work[-500:]) <= 40, max(work)
    assert sum(work[-500:]) <= 2 * sum(work[:500]) + 500
    assert sum(work) / len(work) < 8
    # negative control: decoding the whole output every token grows with the position
    whole = ids_per_token(WholeTextTracker, ids, smollm2_decode)
    assert whole[-1] == len(ids) and sum(whole[-500:]) > 20 * sum(work[-500:])


def test_decode_work_stays_bounded_on_endless_invalid_bytes_and_skipped_tokens(smollm2_decode) -> None:
    """A model that emits undecodable bytes (the text ends in U+FFFD after every token) and special
    tokens the decode skips (EOS under ignore_eos) forever: the window does not grow with them, and
    the stream still equals the full decode."""
    from card.engine.target.stopping import MAX_PENDING

    lone = next(t for t in range(600) if smollm2_decode([t]) == "\ufffd")  # a continuation byte
    lead = smollm2_decode.encode("🎉")[0]  # F0 9F: the first half of a 4-byte sequence
    eos = 2
    ids = smollm2_decode.encode("Hi") + [[lead, lead, eos, lone, lead][i % 5] for i in range(2000)]
    params = StopParams(max_new_tokens=10_000, stop=("\ufffd\ufffd\ufffd!",))
    counting = CountingDecode(smollm2_decode)
    tracker = OutputTracker(params, frozenset(), counting)
    streamed, per_token, pending = "", [], []
    for t in ids:
        before = sum(counting.calls)
        streamed += tracker.feed([t])[1]
        per_token.append(sum(counting.calls) - before)
        pending.append(tracker._detok.pending)
    assert max(pending) == MAX_PENDING  # the safe split kept the undecided run short
    assert max(per_token) <= 200 and sum(per_token[-500:]) <= 2 * sum(per_token[:500]) + 500
    assert len(streamed) > 1000  # streamed as it went, not at the end
    streamed += tracker.finish("length")
    assert streamed == tracker.text == smollm2_decode(ids) and tracker._detok.exact


def test_a_decoder_the_window_cannot_follow_falls_back_to_one_full_decode_at_the_end() -> None:
    """A decode whose text never settles (it always ends in U+FFFD): the window gives up exactness
    after GIVE_UP_PENDING tokens, the stream pauses, and the text is the full decode, once, at the
    end, cut at the first stop string; work per token stays bounded meanwhile."""
    from card.engine.target.stopping import GIVE_UP_PENDING

    decode = lambda ids: "".join(chr(0x3400 + i) for i in ids) + "\ufffd"  # noqa: E731
    ids = list(range(400))
    stop_string = decode([150, 151])[:2]
    for stop, reason in [((), "length"), ((stop_string,), "stop")]:
        counting = CountingDecode(decode)
        tracker = OutputTracker(StopParams(len(ids), stop=stop), frozenset(), counting)
        streamed, per_token = "", []
        for t in ids:
            before = sum(counting.calls)
            streamed += tracker.feed([t])[1]
            per_token.append(sum(counting.calls) - before)
            if tracker.done:
                break
        assert not tracker._detok.exact and tracker.finish_reason == reason
        assert max(per_token[: -1]) <= 20 * GIVE_UP_PENDING
        full = decode(tracker.token_ids)
        assert streamed == tracker.text == (full if reason == "length" else full[: full.find(stop_string)])
        assert len(tracker.token_ids) == (400 if reason == "length" else 152)


def test_stop_matching_reads_each_new_character_a_bounded_number_of_times(monkeypatch) -> None:
    """16 stop strings of 256 characters whose prefixes match all the time and that never match:
    characters the matcher reads per token stay bounded as the output grows to 2,000 tokens, and
    the hold-back never exceeds the longest stop string."""
    from card.engine.shared.config import MAX_STOP_CHARS, MAX_STOP_STRINGS
    from card.engine.target import stopping

    stops = tuple("ab" * 127 + chr(ord("c") + k) + "z" for k in range(MAX_STOP_STRINGS))
    assert all(len(s) == MAX_STOP_CHARS for s in stops)
    read: list[int] = []
    scan = stopping.StopMatcher.scan

    def counting_scan(self, state: int, text: str):
        read.append(len(text))
        return scan(self, state, text)

    monkeypatch.setattr(stopping.StopMatcher, "scan", counting_scan)
    decode = lambda ids: "".join("ab"[i % 2] for i in ids)  # noqa: E731  "abab...": prefixes match
    tracker = OutputTracker(StopParams(max_new_tokens=5000, stop=stops), frozenset(), decode)
    per_token, streamed = [], ""
    for t in range(2000):
        before = sum(read)
        streamed += tracker.feed([t])[1]
        per_token.append(sum(read) - before)
        assert len(tracker.text) - len(streamed) <= MAX_STOP_CHARS - 1
    assert max(per_token) == 1  # one character per token, read once
    assert len(tracker.text) - len(streamed) == 254  # "abab..." is a 254-character prefix of each
    # negative control: the whole-text search reads text that grows with the position
    whole = [len(decode(list(range(k)))) * len(stops) for k in (500, 2000)]
    assert whole[1] == 4 * whole[0]


# ---- the matcher against brute force --------------------------------------------------------------
def test_stop_matcher_state_and_matches_equal_brute_force() -> None:
    import random

    from card.engine.target.stopping import StopMatcher

    rng = random.Random(11)
    for _ in range(300):
        stops = tuple({"".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                       for _ in range(rng.randint(1, 5))})
        matcher = StopMatcher(stops)
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        state, done = 0, 0
        while done < len(text):
            piece = text[done : done + rng.randint(1, 4)]
            before = text[:done]
            state, first = matcher.scan(state, piece)
            seen = before + piece
            # matches that end inside the piece, earliest start
            ends = [i for s in stops for i in range(len(seen) - len(s) + 1)
                    if seen.startswith(s, i) and i + len(s) > len(before)]
            assert first == (min(ends) - len(before) if ends else None), (stops, seen)
            longest = max((n for s in stops for n in range(len(s) + 1) if seen.endswith(s[:n])), default=0)
            assert matcher.depth[state] == longest
            done += len(piece)


# ---- hold-back ------------------------------------------------------------------------------------
def test_held_back_prefix_is_released_when_it_stops_matching() -> None:
    decode = lambda ids: "".join({1: "x", 2: "St", 3: "O", 4: "P", 5: "y"}[i] for i in ids)  # noqa: E731
    tracker = OutputTracker(StopParams(100, stop=("StOP!",)), frozenset(), decode)
    assert tracker.feed([1])[1] == "x"
    assert tracker.feed([2])[1] == ""  # "St" may begin the stop string
    assert tracker.feed([3, 4])[1] == ""  # "StOP" still may
    assert tracker.feed([5])[1] == "StOPy"  # "StOPy" no longer can: released at once
    assert tracker.feed([2, 3, 4])[1] == ""
    _, rest = tracker.feed([1])
    assert rest == "StOPx" and not tracker.done and tracker.text == "xStOPyStOPx"


def test_ending_from_outside_keeps_the_held_back_text() -> None:
    """The engine ends a generation at the context window by setting finish_reason; the held-back
    text belongs to the result, and ``finish`` streams it."""
    tracker = OutputTracker(StopParams(100, stop=("abc",)), frozenset(), letters)
    _, streamed = tracker.feed([25, 0, 1])  # "zab": "ab" held back
    assert streamed == "z"
    assert tracker.finish("length") == "ab" and tracker.text == "zab" and tracker.finish_reason == "length"
    other = OutputTracker(StopParams(100, stop=("abc",)), frozenset(), letters)
    other.feed([25, 0, 1])
    other.finish_reason = "length"
    assert other.text == "zab"


# ---- stop token ids and include_stop_str (vLLM's stop_token_ids, include_stop_str_in_output) ----
def run_stops(model, source, stop: StopParams, decode: Callable[[list[int]], str] = letters) -> Run:
    """``generate`` with any StopParams: one generation alone, what was streamed equal to the result."""
    from card.engine.shared.config import GenerationRequest, SamplingParams
    from card.engine.target.generation import Generation
    from card.engine.target.scheduler import run_alone

    request = GenerationRequest(tuple(PROMPT), SamplingParams(), stop)
    gen = Generation(request, source, eos_ids=frozenset(), decode=decode, context_window=512, mode="test",
                     vocab_size=model.config.vocab_size)
    chunks = list(run_alone(model, gen, False))
    assert gen.result is not None
    assert [t for c in chunks for t in c.token_ids] == gen.result.token_ids
    assert "".join(c.text for c in chunks) == gen.result.text
    return Run(gen.result, chunks)


@pytest.fixture(params=MODES)
def run_stop(request: pytest.FixtureRequest, card) -> Callable[..., tuple[Run, OutputTracker]]:
    mode = request.param

    def go(stop: StopParams, decode: Callable[[list[int]], str] = letters) -> Run:
        source = {"vanilla": NoDraft, "sd": lambda: SyncDraft(target_model("qwen2"), 4),
                  "card": lambda: card}[mode]()
        return run_stops(target_model("qwen2"), source, stop, decode)

    go.mode = mode  # type: ignore[attr-defined]
    return go


def test_stop_token_ids_end_at_the_first_one_in_every_mode(run_stop, reference) -> None:
    """The generation ends at the first of its stop token ids, kept in the tokens; the text ends
    before that token's text, or with it (include_stop_str); inside multi-token commits too."""
    positions = first_positions(reference, 4, start=3)
    unused = next(t for t in range(97) if t not in reference)
    inside = False
    for k, p in enumerate(positions):
        for include in (False, True):
            ids = (unused, *(reference[q] for q in positions[k:]))  # reference[p] is the first to appear
            out = run_stop(StopParams(60, ignore_eos=True, stop_token_ids=ids, include_stop_str=include))
            assert out.tokens == reference[: p + 1], f"stop ids {ids}"
            assert out.result.finish_reason == "stop"
            assert out.result.text == letters(reference[: p + 1 if include else p])
            inside |= cut_inside_commit(out)
    if run_stop.mode != "vanilla":
        assert inside, "no stop token id fell inside a multi-token commit"
    # negative control: ids that never appear leave the generation to its budget
    out = run_stop(StopParams(30, ignore_eos=True, stop_token_ids=(unused,)))
    assert out.tokens == reference[:30] and out.result.finish_reason == "length"


def test_include_stop_str_ends_the_text_with_the_stop_string(run_stop, reference) -> None:
    text = letters(reference)
    for start, length in [(4, 1), (9, 3)]:
        stop = text[start : start + length]
        first = text.find(stop)
        kept = run_stop(StopParams(60, stop=(stop,), ignore_eos=True, include_stop_str=True))
        cut = run_stop(StopParams(60, stop=(stop,), ignore_eos=True))
        assert kept.result.text == text[: first + length] and cut.result.text == text[:first]
        assert kept.tokens == cut.tokens == reference[: first + length]  # the same tokens either way
        assert kept.result.finish_reason == "stop"


def test_stop_reason_names_what_ended_it() -> None:
    decode = lambda ids: "".join({1: "x", 2: "St", 3: "OP", 4: "y", 5: "!"}[i] for i in ids)  # noqa: E731
    stops = StopParams(100, stop=("StOP!", "StOP"), include_stop_str=True)
    tracker = OutputTracker(stops, frozenset(), decode)
    tracker.feed([1, 2, 3, 5])
    assert tracker.text == "xStOP" and tracker.stop_reason == "StOP"  # the shorter one ended first
    tracker = OutputTracker(StopParams(100, stop_token_ids=(4,)), frozenset({4}), decode)
    tracker.feed([1, 4])
    assert tracker.finish_reason == "eos" and tracker.stop_reason is None  # EOS first, as before
    tracker = OutputTracker(StopParams(100, ignore_eos=True, stop_token_ids=(4,)), frozenset({4}), decode)
    tracker.feed([1, 4, 1])
    assert tracker.finish_reason == "stop" and tracker.stop_reason == 4 and tracker.token_ids == [1, 4]
    assert tracker.text == "x"
    tracker = OutputTracker(StopParams(100), frozenset(), decode)
    tracker.feed([1])
    tracker.finish("length")
    assert tracker.text == "x" and tracker.stop_reason is None


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_inside_a_character_leaves_no_replacement_character(smollm2_decode, include) -> None:
    """A stop token id that ends mid-way through a multi-byte character, or completes one: the text
    is that of the tokens before it up to their last clean split (the character it completes goes
    with it, as vLLM drops the characters a stop token added), or everything with
    include_stop_str; stream == text."""
    ids = smollm2_decode.encode("Héllo 🎉🐍 naïve — 東京 end")
    assert any(smollm2_decode(ids[:p]).endswith("\ufffd") for p in range(len(ids))), "no split character"
    for p in range(1, len(ids)):
        if ids[p] in ids[:p]:
            continue
        tracker = OutputTracker(StopParams(1000, stop_token_ids=(ids[p],), include_stop_str=include),
                                frozenset(), smollm2_decode)
        streamed = "".join(tracker.feed([t])[1] for t in ids[: p + 1])
        streamed += tracker.finish("length")  # no-op: ended already
        assert tracker.finish_reason == "stop" and tracker.token_ids == ids[: p + 1]
        before = smollm2_decode(ids[:p])
        clean = next(text for q in range(p, -1, -1)  # the tokens before it up to their last clean split
                     if not (text := smollm2_decode(ids[:q])).endswith("\ufffd") and before.startswith(text))
        want = smollm2_decode(ids[: p + 1]) if include else clean
        assert streamed == tracker.text == want, p
        if not include:
            assert "\ufffd" not in tracker.text


def test_stop_token_ids_are_bounded_and_checked() -> None:
    from card.engine.shared.config import MAX_STOP_TOKEN_IDS
    from card.engine.shared.errors import InvalidArgument

    assert StopParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]
    for bad in [tuple(range(MAX_STOP_TOKEN_IDS + 1)), (-1,), (True,), ("3",)]:
        with pytest.raises(InvalidArgument, match="stop_token_ids"):
            StopParams(stop_token_ids=bad)  # type: ignore[arg-type]
