"""The text of one tokenizer call, part by part, and which of its tokens are trained: what
``samples.SampleBuilder`` tokenizes a conversation with (the compiled pass: ``text_kernels``).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["Marker", "TextChunk", "chunk_labels", "trained_tokens"]


@dataclass(frozen=True, slots=True)
class Marker:
    name: str
    """"image", "bos" or "eos"."""
    text: str
    """The special pieces' text, written into a one-call prompt."""
    ids: np.ndarray
    """The ids the tokenizer gives that text."""
    id_list: list[int]
    """The same, as Python ints (compared with a slice of ids, per record)."""


class TextChunk:
    """The text of one tokenizer call, part by part (parallel lists: one entry per part)."""

    __slots__ = ("texts", "trained", "content", "bounds", "slots")

    def __init__(self):
        self.texts: list[str] = []
        """Text of each part (a marker's special pieces for a marker)."""
        self.trained: list[bool] = []
        """Whether each part's tokens are label targets."""
        self.content: list[bool] = []
        """Conversation text: a control id inside it is spelled as text."""
        self.bounds: list[int] = [0]
        """Character offset where each part starts, and the text's length last."""
        self.slots: list[tuple[int, int, Marker, np.ndarray, bool]] = []
        """(start, end, marker, what it becomes: an image run or a BOS/EOS id, trained) per marker."""

    def add(self, text: str, trained: bool, content: bool) -> None:
        self.texts.append(text)
        self.trained.append(trained)
        self.content.append(content)
        self.bounds.append(self.bounds[-1] + len(text))

    def add_marker(self, marker: Marker, trained: bool, ids: np.ndarray) -> None:
        self.slots.append((self.bounds[-1], self.bounds[-1] + len(marker.text), marker, ids, trained))
        self.add(marker.text, trained, False)

    def has_content(self, start: int, end: int) -> bool:
        """Whether characters start..end (exclusive) hold conversation text."""
        part = bisect.bisect_right(self.bounds, start) - 1
        while part < len(self.texts) and self.bounds[part] < end:
            if self.content[part]:
                return True
            part += 1
        return False


def chunk_labels(ids, starts, ends, bounds, trained, is_control) -> tuple[np.ndarray, np.ndarray, bool]:
    """Labels of a chunk's tokens in one compiled pass: (trained mask, positions of control ids,
    whether the tokens are ordered non-overlapping spans).

    The chunk's text is parts starting at ``bounds`` (its length last), ``trained`` or not. A token is trained
    when its characters overlap a trained part; a zero-width token (a sentencepiece "▁" or byte
    piece) takes the flag of the character where it sits (the last one at the end)::

        parts    "USER: hi "  "ASSISTANT:"  " "  "ok"      trained: .  .  x  x
        tokens   ▁USER : ▁hi ▁ASS IST ANT :  ▁ok                 ▁ok overlaps " " and "ok": x
    """
    return _chunk_labels_kernel()(ids, starts, ends, bounds, trained, is_control)


@functools.cache
def _chunk_labels_kernel():
    """Loaded on first use: a process that never tokenizes never imports numba."""
    from neva_pack.text.text_kernels import chunk_labels_kernel

    return chunk_labels_kernel


def trained_tokens(starts: np.ndarray, ends: np.ndarray, trained_chars: np.ndarray) -> np.ndarray:
    """A token is trained when its characters overlap trained text; a zero-width token (a
    sentencepiece "▁" or byte piece) takes the flag of the character where it sits."""
    if len(starts) == 0:
        return np.zeros(0, dtype=bool)
    cumulative = np.concatenate([[0], np.cumsum(trained_chars)])
    overlaps = cumulative[ends] - cumulative[starts] > 0
    zero_width = ends <= starts
    if zero_width.any() and len(trained_chars):
        at = np.minimum(starts[zero_width], len(trained_chars) - 1)
        overlaps[zero_width] = trained_chars[at]
    return overlaps
