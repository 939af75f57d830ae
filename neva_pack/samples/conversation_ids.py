"""Conversation -> a sample's ids before truncation: the template rendered, the text tokenized, the
image placeholders expanded into image runs, BOS/EOS placed, and which positions are trained.

Conversation text never yields a control id: the chunk's one tokenizer call is repaired by character
span (``_encode_chunk``): a marker's pieces (an image, BOS, EOS written inside a one-call prompt)
become its ids, and a control id whose text a user typed is spelled as ordinary text.
"""

from __future__ import annotations

import numpy as np

from neva_pack.core import ConfigError, ImageRun
from neva_pack.families import IMAGE_DELIMITER_PIECES
from neva_pack.text import (
    Marker, Piece, Template, TextChunk, Tokenization, Tokenizer, chunk_labels, render, trained_tokens
)
from neva_pack.records import IMAGE_PLACEHOLDER, Conversation, RecordError, Turn

__all__ = ["ConversationIds"]

NEMO_SPECIAL_TEXT = {"bos": "<extra_id_6>", "eos": "<extra_id_7>"}
"""How NeMo's templates write BOS/EOS in the prompt text before mapping their ids to 1/2."""

_PROBE_TURNS = (Turn("user", "<image>q"), Turn("assistant", "a"), Turn("user", "q"), Turn("assistant", "a"))
"""A small conversation, rendered once to find which special tokens a template uses."""


class ConversationIds:
    """The text side of a SampleBuilder: one conversation's (ids, trained mask, image run starts)."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        template: Template,
        image_run: ImageRun,
        tokenization: Tokenization,
        system_prompt: str | None,
        max_conversation_chars: int,
    ):
        self.tokenizer = tokenizer
        self.template = template
        self.image_run = image_run
        self.tokenization = tokenization
        self.system_prompt = system_prompt
        self.max_conversation_chars = max_conversation_chars
        self._run_ids = None if image_run.dynamic else image_run.ids()
        self._special_ids = self._resolve_specials()
        self._special_runs = {name: np.asarray([i], dtype=np.int64) for name, i in self._special_ids.items() if i is not None}
        self._run_masks: dict[tuple[str, bool, int], np.ndarray] = {}
        self._is_control = np.zeros(tokenizer.vocab_size, dtype=bool)
        self._is_control[list(tokenizer.control_ids)] = True
        empty = np.zeros(0, dtype=np.int64)
        chunk_labels(empty, empty, empty, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=bool), self._is_control)  # compile before a fork
        self._markers = self._resolve_markers() if self.tokenization.one_call else {}

    def _resolve_specials(self) -> dict[str, int]:
        probe = render(self.template, _PROBE_TURNS[:2] if self.template.one_round_only else _PROBE_TURNS)
        ids = {"bos": self.tokenizer.bos_id, "eos": self.tokenizer.eos_id}
        for piece in probe:
            if piece.kind == "special" and ids[piece.value] is None:
                raise ConfigError(
                    f"template {self.template.name!r} needs the tokenizer's {piece.value.upper()} token, "
                    f"but {self.tokenizer.name} defines none"
                )
        return ids

    def _resolve_markers(self) -> dict[str, Marker]:
        """How images and BOS/EOS are written inside a one-call prompt (NeMo): as the tokenizer's
        special pieces, which the tokenizer never merges with the text around them. A special
        the tokenizer has no piece for splits the prompt there instead (as LLaVA)."""
        markers = {}
        candidates = {"eos": [NEMO_SPECIAL_TEXT["eos"]], "bos": [NEMO_SPECIAL_TEXT["bos"]]}
        run = self.image_run
        if run.start_id is not None and run.end_id is not None:
            written = [run.start_id, run.end_id]  # NeMo's <extra_id_4>/<extra_id_5>, Qwen's <|vision_start|>/<|vision_end|>
            pieces = [list(texts) for texts in IMAGE_DELIMITER_PIECES]
        elif run.dynamic and run.start_id is None and run.end_id is None:
            written, pieces = [run.patch_id], [[IMAGE_PLACEHOLDER]]  # LLaVA-NeXT / OneVision: their <image> token
        else:
            written, pieces = None, []
        for texts in pieces:  # the image marker: the tokenizer's own pieces for the run's delimiters
            if [self.tokenizer.token_to_id(text) for text in texts] == written:
                candidates["image"] = texts
        for name, texts in candidates.items():
            ids = [self.tokenizer.token_to_id(text) for text in texts]
            if all(i is not None and i in self.tokenizer.control_ids for i in ids):
                markers[name] = Marker(name=name, text="".join(texts), ids=np.asarray(ids, dtype=np.int64), id_list=ids)
        return markers

    def encode(self, conversation: Conversation, image_features=None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The text side of a sample, before truncation: (ids, trained mask, start of each image
        run). No pixels are read; the parity tests against NeMo's and LLaVA's goldens call this.
        ``image_features``: a dynamic run's features per image, in placeholder order (a video clip's
        entry: its run's ids, as its family spells them)."""
        record_system = conversation.system if self.template.system_from_record else None
        pieces = render(self.template, conversation.turns, self.system_prompt, record_system)
        if self.image_run.dynamic:
            images = sum(piece.kind == "image" for piece in pieces)
            if image_features is None or len(image_features) != images:
                raise ValueError(f"a dynamic image run needs the features of each of the {images} images")
        return self._encode(pieces, image_features)

    def _encode(self, pieces: list[Piece], image_features=None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Pieces -> (ids, trained mask, start position of each image run).

        Text is tokenized in chunks: under ``nemo`` the whole prompt is one chunk, images and
        BOS/EOS written inside it as special pieces (NeMo tokenizes its prompt in one call);
        under ``llava`` a chunk ends at every image (LLaVA's tokenizer_image_token), so the text
        after an image starts a new sentencepiece sentence (a leading "▁"), while text after
        BOS/EOS goes on without one (LLaVA-1.5's slow tokenizer, legacy=False). The mask comes
        from the character offsets of the tokens actually emitted.

        The pieces are first laid out as chunks and id runs, counting the template's text, so a
        conversation too long once templated is refused before anything is tokenized.
        """
        segments: list[TextChunk | tuple[np.ndarray, np.ndarray, bool]] = []
        chunk = None
        rendered = 0
        image = 0  # the next image's index in image_features
        for piece in pieces:
            kind = piece.kind
            if kind == "text" or kind == "content":
                value = piece.value
                if value:
                    if chunk is None:
                        chunk = TextChunk()
                        segments.append(chunk)
                        texts, trained, content, bounds = chunk.texts, chunk.trained, chunk.content, chunk.bounds
                    texts.append(value)  # chunk.add, inlined: the loop runs for every piece of every record
                    trained.append(piece.trained)
                    content.append(kind == "content")
                    bounds.append(bounds[-1] + len(value))
                    if kind == "text":
                        rendered += len(value)
                continue
            name = "image" if kind == "image" else piece.value
            if kind != "image":
                ids = self._special_runs[name]
            elif image_features is None:
                ids = self._run_ids
            else:
                feature = image_features[image]  # a count of features, or a video clip's whole run of ids
                ids = feature if isinstance(feature, np.ndarray) else self.image_run.ids(feature)
                image += 1
            marker = self._markers.get(name)
            if marker is not None:
                if chunk is None:
                    chunk = TextChunk()
                    segments.append(chunk)
                    texts, trained, content, bounds = chunk.texts, chunk.trained, chunk.content, chunk.bounds
                chunk.add_marker(marker, piece.trained, ids)
                continue
            chunk = None
            segments.append((ids, self._run_mask(name, piece.trained, len(ids)), kind == "image"))
        if rendered > self.max_conversation_chars:  # many short turns: the template's text counts too
            raise RecordError(
                "conversation_too_long",
                f"{rendered:,} characters once templated > --max_conversation_chars {self.max_conversation_chars:,}",
            )
        id_parts: list[np.ndarray] = []
        mask_parts: list[np.ndarray] = []
        image_starts: list[int] = []
        position = 0
        continues = False  # the chunk goes on after a BOS/EOS: no new leading "▁"
        for segment in segments:
            if type(segment) is TextChunk:
                ids, mask, starts = self._encode_chunk(segment, continues)
                image_starts.extend(position + k for k in starts)
            else:
                ids, mask, image = segment
                # an image starts a new sentencepiece sentence under llava (tokenizer_image_token);
                # NeMo's one call and LLaVA's slow tokenizer (legacy=False) go on after BOS/EOS;
                # a BOS that opens the sequence is the tokenizer's own: the text after it starts fresh
                continues = (self.tokenization.one_call or not image) and position > 0
                if image:
                    image_starts.append(position)
            id_parts.append(ids)
            mask_parts.append(mask)
            position += len(ids)
        if not id_parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), []
        if len(segments) == 1 and type(segments[0]) is TextChunk:  # the ids are this sample's own
            return id_parts[0], mask_parts[0], image_starts
        return np.concatenate(id_parts), np.concatenate(mask_parts), image_starts

    def _run_mask(self, name: str, trained: bool, length: int) -> np.ndarray:
        """The mask of an image run or a BOS/EOS id (shared: only ever copied into a sample)."""
        key = (name, trained, length)
        if key not in self._run_masks:
            if len(self._run_masks) > 4096:  # dynamic runs: one length per image size
                self._run_masks.clear()
            self._run_masks[key] = np.full(length, trained)
        return self._run_masks[key]

    def _encode_chunk(self, chunk: TextChunk, continues: bool) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """One tokenizer call over the chunk's text, then two repairs, both by character span:
        a marker's pieces become its ids (an image run, BOS, EOS); a control id whose text a
        user typed (``</s>``, ``<extra_id_4>``, ``<|im_start|>``...) is spelled as ordinary
        text instead; everything else is exactly what the tokenizer gave.

        ``continues``: the text follows a BOS/EOS id (or, under ``nemo``, a special the tokenizer
        has no piece for); it goes on without a new leading "▁", as in one call, and is spelled
        without any control id."""
        text = "".join(chunk.texts)
        encoding = self.tokenizer.encode_literal(text) if continues else self.tokenizer.encode(text)
        ids = encoding.ids
        mask, flagged, ordered = chunk_labels(
            ids, encoding.starts, encoding.ends, np.array(chunk.bounds), np.array(chunk.trained), self._is_control
        )
        if not len(flagged):
            return ids, mask, []
        replaced = self._replace_markers(chunk, encoding, mask, flagged) if ordered else None
        if replaced is not None:
            return replaced
        return self._repair(chunk, text, encoding, mask, flagged)

    def _replace_markers(self, chunk: TextChunk, encoding, mask, flagged) -> tuple | None:
        """The usual case of ``_repair``, cheaply, for tokens that are ordered, non-overlapping
        spans (sentencepiece's): every control id of the chunk is a marker's own piece, exactly
        where the marker's text is, or template text's (nvgpt's <extra_id_1>); None for anything
        else (``_repair`` then decides, or raises)."""
        ids, starts, ends = encoding.ids, encoding.starts, encoding.ends
        firsts = np.searchsorted(ends, [slot[0] for slot in chunk.slots], side="right").tolist()  # first token past it
        in_place = True
        at_markers = 0
        for (start, end, marker, new, _), first in zip(chunk.slots, firsts):
            count = len(marker.id_list)
            last = first + count - 1
            if last >= len(ids) or starts[first] != start or ends[last] != end:
                return None
            if ids[first : last + 1].tolist() != marker.id_list:
                return None
            if count > 1 and not (ends[first : last + 1] > starts[first : last + 1]).all():
                return None  # a zero-width token among its pieces
            in_place = in_place and count == len(new) and marker.name != "image"
            at_markers += count
        if len(flagged) > at_markers:  # control ids besides the markers' own (all flagged)
            markers = {first + j for (_, _, marker, _, _), first in zip(chunk.slots, firsts) for j in range(len(marker.id_list))}
            for k in flagged.tolist():
                if k not in markers and chunk.has_content(int(starts[k]), max(int(ends[k]), int(starts[k]) + 1)):
                    return None  # a control id a user typed: spelled as text by _repair
        if in_place:  # BOS/EOS: one id for one piece
            for (_, _, marker, new, trained), first in zip(chunk.slots, firsts):
                ids[first : first + len(new)] = new
                mask[first : first + len(new)] = trained
            return ids, mask, []
        out_ids, out_mask, image_starts = [], [], []
        previous = position = 0
        for (_, _, marker, new, trained), first in zip(chunk.slots, firsts):
            out_ids.append(ids[previous:first])
            out_mask.append(mask[previous:first])
            position += first - previous
            if marker.name == "image":
                image_starts.append(position)
            out_ids.append(new)
            out_mask.append(np.full(len(new), trained))
            position += len(new)
            previous = first + len(marker.id_list)
        out_ids.append(ids[previous:])
        out_mask.append(mask[previous:])
        return np.concatenate(out_ids), np.concatenate(out_mask), image_starts

    def _repair(self, chunk: TextChunk, text: str, encoding, mask, flagged) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Every control id of the chunk, one by one: a marker's pieces must be exactly its ids
        (they become its image run or BOS/EOS); one in text a user typed is spelled literally."""
        ids = encoding.ids
        lengths = np.diff(chunk.bounds)
        trained_chars = np.repeat(np.array(chunk.trained, dtype=bool), lengths)
        content_chars = np.repeat(np.array(chunk.content, dtype=bool), lengths)
        replace: dict[int, tuple[np.ndarray, np.ndarray, bool] | None] = {}
        for start, end, marker, new_ids, trained in chunk.slots:
            inside = (encoding.starts >= start) & (encoding.ends <= end) & (encoding.ends > encoding.starts)
            straddle = (encoding.starts < end) & (encoding.ends > start) & ~inside
            found = np.flatnonzero(inside)
            if straddle.any() or not np.array_equal(ids[found], marker.ids):
                raise RuntimeError(f"{self.tokenizer.name} did not keep {marker.text!r} as its own pieces")
            replace[int(found[0])] = (new_ids, np.full(len(new_ids), trained), marker.name == "image")
            replace.update({int(k): None for k in found[1:]})
        for k in flagged:
            k = int(k)
            start, end = int(encoding.starts[k]), int(encoding.ends[k])
            if k in replace or not content_chars[start:max(end, start + 1)].any():
                continue  # a marker, or the template's own text (nvgpt's <extra_id_1>, a Llama-3 header)
            literal = self.tokenizer.encode_literal(text[start:end])
            replace[k] = (literal.ids, trained_tokens(literal.starts, literal.ends, trained_chars[start:end]), False)
        out_ids, out_mask, image_starts = [], [], []
        position, previous = 0, 0
        for k in sorted(replace):
            out_ids.append(ids[previous:k])
            out_mask.append(mask[previous:k])
            position += k - previous
            previous = k + 1
            if replace[k] is None:
                continue
            new_ids, new_mask, is_image = replace[k]
            if is_image:
                image_starts.append(position)
            out_ids.append(new_ids)
            out_mask.append(new_mask)
            position += len(new_ids)
        out_ids.append(ids[previous:])
        out_mask.append(mask[previous:])
        return np.concatenate(out_ids), np.concatenate(out_mask), image_starts
