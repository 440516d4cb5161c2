"""Token ids in, text out, for a generation: multi-byte characters and stop strings that split
across tokens and commits are handled here, once, for every surface."""

from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    """Token ids in, text out: safe for multi-byte characters split across tokens, and for stop
    strings split across chunks (text that could still start a stop string is held back).

    Tokens are fed one at a time so that the token completing a stop string is known exactly:
    `stop_string` is the string that matched, `stop_token_index` the index of that token."""

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        keep_leading_space: bool = False,
    ):
        from ..compat import fresh_detokenizer

        self.detok = fresh_detokenizer(tokenizer, keep_leading_space)
        self.stop = [s for s in stop if s]
        self.on_text = on_text
        self.text = ""
        self.emitted = 0
        self.n_tokens = 0
        self.stopped = False
        self.stop_string: str | None = None
        self.stop_token_index: int | None = None
        self.finished = False

    def _emit(self, upto: int) -> None:
        if upto > self.emitted and self.on_text is not None:
            self.on_text(self.text[self.emitted : upto])
        self.emitted = max(self.emitted, upto)

    def _check_stop(self) -> bool:
        hits = [(self.text.find(s), s) for s in self.stop if s in self.text]
        if not hits:
            return False
        at, s = min(hits)
        self.text = self.text[:at]
        self.stopped, self.stop_string = True, s
        self.stop_token_index = self.n_tokens - 1
        return True

    def add(self, tokens: Sequence[int]) -> bool:
        """Feed tokens; return True once a stop string has been produced."""
        for t in tokens:
            self.detok.add_token(int(t))
            self.n_tokens += 1
            if self.stop:
                self.text = self.detok.text
                if self._check_stop():
                    self._emit(len(self.text))
                    return True
        self.text = self.detok.text
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        text_ready = len(self.text) - hold
        # A trailing replacement char means an incomplete multi-byte sequence: hold it back.
        while text_ready > self.emitted and self.text[text_ready - 1] == "\ufffd":
            text_ready -= 1
        self._emit(text_ready)
        return False

    def finish(self) -> str:
        """Release what was held back; idempotent."""
        if self.finished:
            return self.text
        self.finished = True
        if not self.stopped:
            self.detok.finalize()
            self.text = self.detok.text
            self._check_stop()
        self._emit(len(self.text))
        return self.text
