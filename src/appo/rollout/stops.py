"""Stop detection on decoded text: multi-token stop strings and EOS, per row.

A stop string such as `</python>` is one token for some tokenizers and three for others
(SmolLM2: `</` `python` `>`), and the token that completes it may carry extra characters.
So stops are found on the decoded text of the tail of the row's current segment, never on
single ids. The token that completes the stop string is kept (docs/algorithms.md §1.3).

Cost control: a stop string can only be completed by a token whose text contains the
string's last character, so most steps skip decoding entirely (`may_complete` table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class StopChecker:
    tokenizer: object
    stop_strings: Sequence[str]
    eos_ids: frozenset[int]
    _may_complete: list[bool] | None = field(default=None, repr=False)
    window: int = 0

    def __post_init__(self) -> None:
        self.stop_strings = tuple(s for s in self.stop_strings if s)
        # Each token adds at least one character of an ASCII stop string, so the stop string
        # lies within its last len(s) tokens; one more covers a token that also carries text
        # before the stop string's first character.
        self.window = max((len(s) for s in self.stop_strings), default=0) + 1
        if self.stop_strings:
            vocab = len(self.tokenizer)
            texts = self.tokenizer.batch_decode([[i] for i in range(vocab)])
            last_chars = {s[-1] for s in self.stop_strings}
            # A token that decodes to a replacement char may be part of a multi-byte
            # character; its text alone does not show what it completes, so check it.
            self._may_complete = [
                any(c in t for c in last_chars) or "\ufffd" in t for t in texts
            ]

    def check(self, segment_ids: Sequence[int]) -> str | None:
        """The stop string completed by the last token of `segment_ids`, or None.

        `segment_ids` are the tokens of the current model segment (not the prompt or the
        forced tool results before it, which may quote a closing tag).
        """
        if not segment_ids or not self.stop_strings:
            return None
        last = segment_ids[-1]
        if self._may_complete is not None and last < len(self._may_complete):
            if not self._may_complete[last]:
                return None
        window = list(segment_ids[-self.window :])
        tail = self.tokenizer.decode(window)
        hits = [s for s in self.stop_strings if s in tail]
        if not hits:
            return None
        # Only a stop string that the last token completed counts.
        before = self.tokenizer.decode(window[:-1])
        hits = [s for s in hits if s not in before]
        return min(hits, key=tail.find) if hits else None

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_ids


def eos_ids_of(tokenizer, model=None) -> frozenset[int]:
    """Every EOS id the tokenizer and the model's generation config know of."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return frozenset(ids)


def tool_stop_strings(tags: Sequence[str]) -> list[str]:
    return [f"</{tag}>" for tag in tags]
