"""End-of-generation rules and streamed detokenization.

Tokens are committed in bursts (a verification commits several); ``OutputTracker.feed`` takes
them one at a time, so EOS, stop token ids, the token budget and stop strings cut at exactly the
token where the generation must end, whatever the burst size (card commits the same tokens as plain
decoding, so it ends at the same one). Text that could still become a stop string (or an
incomplete UTF-8 sequence) is held back from the stream until it is decided.

Every token costs work bounded independently of the length of the output (this runs on the
engine's thread, between forwards of every generation in the batch):

* ``IncrementalDecoder`` decodes a short window of recent tokens (the prefix_offset / read_offset
  technique of vLLM and TGI), never the whole output;
* ``StopMatcher`` (Aho-Corasick over the stop strings, at most MAX_STOP_STRINGS of MAX_STOP_CHARS
  characters) reads each new character once; its state is the longest suffix of the text that is
  a prefix of some stop string, which is exactly the text to hold back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

from card.engine.shared.config import StopParams

Decode = Callable[[list[int]], str]

# Tokens the decoder holds undecided (their text ends in an incomplete UTF-8 sequence, or decodes
# inconsistently with the committed context) before it looks for a safe split inside them, and the
# splits it tries then. A character is at most 4 bytes and a token at least one, so real text
# resolves within 4 tokens; longer runs are invalid bytes, which the split releases.
MAX_PENDING = 8
SPLITS_TRIED = 4
# Undecided tokens after which the decoder gives up exactness (no tokenizer card serves gets here):
# the stream pauses and the final text is the full decode (see OutputTracker).
GIVE_UP_PENDING = 32


class IncrementalDecoder:
    """Text of a growing token sequence, ``decode(ids)`` over a window of recent tokens only.

    The window holds *context* tokens (committed already, ending at a clean split) and *pending*
    tokens. Each step decodes the window; when its text extends the context's text and does not
    end in U+FFFD (an incomplete UTF-8 sequence) the pending tokens are committed: the text past
    the context's is returned, and they become the next context. The concatenation of the returned
    pieces plus ``pending_text`` equals ``decode(all ids)`` for decoders whose output past a clean
    split does not depend on what came before the previous one: byte-level BPE (GPT-2, Llama 3,
    Qwen, SmolLM2) and SentencePiece with byte fallback, the tokenizers card serves.

    Bounded work per token even for a model that emits invalid bytes forever: past MAX_PENDING
    undecided tokens it tries the last SPLITS_TRIED split points and commits up to one that is safe
    (the window's text is the text before it plus the text after it, and the text after it is not
    empty: an incomplete sequence at the split would have merged with the byte after it); past
    GIVE_UP_PENDING it commits the window as decoded and clears ``exact``.
    """

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._window: list[int] = []
        self._context = 0  # leading tokens of the window that are committed
        self._context_text = ""  # decode(window[:context])
        # the pending tokens' text as decoded now (may end in U+FFFD); past the common prefix with the
        # context's text when the window's text does not extend it (``consistent`` False)
        self.pending_text = ""
        self.consistent = True
        self.exact = True

    @property
    def pending(self) -> int:
        return len(self._window) - self._context

    def step(self, token: int) -> str:
        """Add ``token``; returns the text it commits (often "")."""
        window, context_text = self._window, self._context_text
        window.append(token)
        text = self._decode(window)
        if text.startswith(context_text) and len(text) > len(context_text) and not text.endswith("\ufffd"):
            self._commit(len(window))
            return text[len(context_text):]
        self._pending(text)
        if self.consistent and context_text and len(text) == len(context_text):
            # tokens that add nothing (special tokens the decode skips, e.g. EOS under ignore_eos)
            # leave the window, which stays as short as the text needs
            del window[self._context:]
            return ""
        if self.pending > MAX_PENDING:
            return self._resync(text)
        return ""

    def _pending(self, text: str) -> None:
        """The pending tokens' text, given the window's."""
        context_text = self._context_text
        self.consistent = text.startswith(context_text)
        self.pending_text = text[len(context_text) if self.consistent else _common(text, context_text):]

    def _commit(self, split: int) -> None:
        """Window tokens before ``split`` are committed: those after the old context become the
        context; the rest stay pending."""
        window = self._window[self._context:]
        self._window, self._context = window, split - self._context
        self._context_text = self._decode(window[:self._context])
        self._pending(self._decode(window) if self.pending else self._context_text)

    def _resync(self, text: str) -> str:
        window, context, context_text = self._window, self._context, self._context_text
        for split in range(len(window) - 1, max(context, len(window) - 1 - SPLITS_TRIED), -1):
            head = self._decode(window[:split])
            if not (head.startswith(context_text) and text.startswith(head)):
                continue
            tail = self._decode(window[split:])
            if tail and head + tail == text:
                self._commit(split)
                return head[len(context_text):]
        if self.pending <= GIVE_UP_PENDING:
            return ""
        self.exact = False
        delta = text[_common(text, context_text):]
        self._window, self._context = window[-1:], 0
        self._commit(1)
        return delta


def _common(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class StopMatcher:
    """Aho-Corasick automaton of a set of stop strings.

    A state is a node of the trie of the stop strings: the longest suffix of the text read so far
    that is a prefix of some stop string (its ``depth``). Reading a character follows at most the
    failure links that the depth climbed, so a text costs time linear in its length whatever the
    stop strings; building costs time linear in their total length.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        children: list[dict[str, int]] = [{}]
        depth = [0]
        ends = [0]  # length of the stop string that ends at this node (0: none)
        for s in stops:
            node = 0
            for c in s:
                nxt = children[node].get(c)
                if nxt is None:
                    nxt = children[node][c] = len(children)
                    children.append({})
                    depth.append(depth[node] + 1)
                    ends.append(0)
                node = nxt
            ends[node] = len(s)
        fail = [0] * len(children)
        match = ends[:]  # the longest stop string that is a suffix of the node's string
        queue = list(children[0].values())
        for node in queue:  # breadth first: a node's failure target is shallower, so done already
            for c, child in children[node].items():
                f = fail[node]
                while f and c not in children[f]:
                    f = fail[f]
                fail[child] = children[f].get(c, 0)
                match[child] = match[child] or match[fail[child]]
                queue.append(child)
        self._children, self._fail, self._match = children, fail, match
        self.depth = depth

    def scan(self, state: int, text: str) -> tuple[int, int | None]:
        """Read ``text`` from ``state``: (the state after it, the smallest index relative to
        ``text`` (negative: before it) at which a stop string starts that ends inside it, or
        None)."""
        children, fail, match = self._children, self._fail, self._match
        first: int | None = None
        for i, c in enumerate(text):
            while state and c not in children[state]:
                state = fail[state]
            state = children[state].get(c, 0)
            if match[state]:
                start = i + 1 - match[state]
                if first is None or start < first:
                    first = start
        return state, first


@functools.lru_cache(maxsize=32)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton of ``stops``, shared by the requests that name the same ones."""
    return StopMatcher(stops)


class OutputTracker:
    """One generation's output: its tokens, the end rule, its text and the stream of it.

    ``text`` is ``decode(token_ids)``, cut before the first stop string when one ends the
    generation (after it with ``include_stop_str``), or before the text of a stop token id (the
    id stays in ``token_ids``, as EOS does; a character it completes goes with it, as vLLM
    removes the characters a stop token added); the deltas ``feed`` returns add up to it. Should the
    window decoder give up exactness (``IncrementalDecoder``: only a tokenizer whose decoding past
    a clean split depends on earlier tokens gets there), the stream pauses and the text is decoded
    in full once, at the end.
    """

    def __init__(self, stop: StopParams, eos_ids: frozenset[int], decode: Decode) -> None:
        self.stop = stop
        self.eos_ids = eos_ids
        self.decode = decode
        self.stop_ids = frozenset(stop.stop_token_ids)
        # what ended a "stop": the stop string or the stop token id (vLLM's ``stop_reason``)
        self.stop_reason: str | int | None = None
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of ``text`` already streamed
        self._reason: str | None = None
        self._detok = IncrementalDecoder(decode)
        self._matcher = stop_matcher(stop.stop) if stop.stop else None
        self._state = 0  # the matcher's state after the committed text
        self._pieces: list[str] = []  # the committed text, as the decoder committed it
        self._length = 0  # characters in _pieces
        self._unsent = ""  # the end of the committed text not streamed yet (bounded by the hold-back)
        self._final: str | None = None

    # ---- state ---------------------------------------------------------------------------------
    @property
    def finish_reason(self) -> str | None:
        return self._reason

    @finish_reason.setter
    def finish_reason(self, reason: str | None) -> None:
        """Ending from outside (the context window is full): what is held back belongs to the text;
        ``finish`` also returns it for the stream."""
        if reason is not None and self._reason is None:
            self._finish(reason, None)

    @property
    def done(self) -> bool:
        return self._reason is not None

    @property
    def text(self) -> str:
        if self._final is not None:
            return self._final
        return "".join(self._pieces) + self._detok.pending_text

    # ---- feeding -------------------------------------------------------------------------------
    def feed(self, tokens: Iterable[int]) -> tuple[list[int], str]:
        """Take committed tokens until a stop; returns (tokens kept, text safe to stream)."""
        kept: list[int] = []
        for token in tokens:
            if self.done:
                break
            self.token_ids.append(token)
            kept.append(token)
            before = self._length  # the text before this token, to its last whole character
            cut = self._read(token)
            if token in self.eos_ids and not self.stop.ignore_eos:
                self._finish("eos", None)
            elif cut is not None:
                self._finish("stop", cut)
            elif token in self.stop_ids:
                self.stop_reason = token
                self._finish("stop", None if self.stop.include_stop_str else before, by_token=True)
            elif len(self.token_ids) >= self.stop.max_new_tokens:
                self._finish("length", None)
        return kept, self._stream()

    def finish(self, reason: str) -> str:
        """End the generation for ``reason`` (if it has not ended); returns the rest of the text to
        stream."""
        self.finish_reason = reason
        return self._stream()

    def _read(self, token: int) -> int | None:
        """Decode ``token``; the index in the text where the first stop string starts, if one has
        appeared."""
        delta = self._detok.step(token)
        if delta:
            self._pieces.append(delta)
            self._length += len(delta)
            if self._detok.exact:
                self._unsent += delta
        if self._matcher is None:
            return None
        base = self._length - len(delta)
        self._state, first = self._matcher.scan(self._state, delta)
        cut = None if first is None else base + first
        if self._detok.pending_text:  # undecided text can complete a stop string too
            _, first = self._matcher.scan(self._state, self._detok.pending_text)
            if first is not None and (cut is None or self._length + first < cut):
                cut = self._length + first
        return cut

    def _finish(self, reason: str, cut: int | None, by_token: bool = False) -> None:
        """End for ``reason``; ``cut``: where the text ends (None: all of it), a stop string's
        start or the text before a stop token (``by_token``)."""
        self._reason = reason
        detok = self._detok
        text = "".join(self._pieces) + detok.pending_text
        if reason == "stop" and not by_token and cut is not None:
            cut = self._stop_string_end(text, cut)
        if detok.exact and detok.consistent:
            self._final = text if cut is None else text[:cut]
            return
        # the window decoder lost track: the text is the full decode, once
        full = self.decode(self.token_ids)
        if by_token and cut is not None:
            full = self.decode(self.token_ids[:-1]).rstrip("\ufffd")  # whole characters only
        elif reason == "stop" and not by_token:
            hits = [i for s in self.stop.stop if (i := full.find(s)) >= 0]
            full = full[: self._stop_string_end(full, min(hits))] if hits else full
        streamed = "".join(self._pieces)[: self.emitted]
        if full.startswith(streamed):
            self._final = full
        else:  # cannot unsay what was streamed: keep the text the stream agrees with
            self._final = text if cut is None else text[:cut]

    def _stop_string_end(self, text: str, start: int) -> int:
        """Where the text ends when the first stop string starts at ``start``: there, or past the
        stop string (``include_stop_str``); records it as the stop reason. Of the stop strings
        that start there the shortest ended the generation (the longer ones end later)."""
        stop = min((s for s in self.stop.stop if text.startswith(s, start)), key=len, default="")
        self.stop_reason = stop or None
        return start + len(stop) if self.stop.include_stop_str else start

    def _stream(self) -> str:
        if self._final is not None:
            delta = self._final[self.emitted:]
        elif not self._detok.exact:
            return ""  # paused until the final decode
        else:
            hold = self._matcher.depth[self._state] if self._matcher is not None else 0
            delta = self._unsent[: max(0, len(self._unsent) - hold)]
            self._unsent = self._unsent[len(delta):]
        self.emitted += len(delta)
        return delta
