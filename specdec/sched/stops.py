"""Stop strings: found on the decoded text as tokens are accepted, wherever they fall (inside a drafted
run, or across tokens)."""

from __future__ import annotations


class StopStrings:
    """Finds the first stop string that a round's accepted tokens complete."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def find(self, before: list[int], emitted: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
        """(j, s): the first j tokens of `emitted` complete stop string s after the row's generated tokens
        `before` (None if no stop string ends within `emitted`). Decodes a window of the last tokens: a stop
        string of c characters spans at most c tokens."""
        if self.tokenizer is None:
            raise ValueError("stop strings need the target's tokenizer")
        longest = max(len(s) for s in stops)
        tail = before[-(longest + 1):]
        seen = len(self._text(tail))
        for j in range(1, len(emitted) + 1):
            text = self._text(tail + emitted[:j])
            for s in stops:
                if text.find(s, max(0, seen - len(s) + 1)) >= 0:  # a match that uses a new character
                    return j, s
        return None

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def cut_at_stop(text: str, stop: str | None) -> str:
    """A completion ends before its stop string."""
    if stop is None:
        return text
    at = text.find(stop)
    return text if at < 0 else text[:at]
