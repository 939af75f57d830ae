"""Text: tokenizers behind one small protocol, conversation templates as YAML data, and the compiled
loops of tokenization. Nothing here knows about images beyond the placeholder string.
"""

from neva_pack.text.label_chunks import Marker, TextChunk, chunk_labels, trained_tokens
from neva_pack.text.templates import DEFAULT_TOKENIZATION, Piece, TOKENIZATIONS, Template, Tokenization, available_templates, load_template, render
from neva_pack.text.tokenizer import SentencePieceTokenizer, Tokenizer, WordCache, load_tokenizer

__all__ = [
    "DEFAULT_TOKENIZATION",
    "Marker",
    "Piece",
    "SentencePieceTokenizer",
    "TOKENIZATIONS",
    "Template",
    "TextChunk",
    "Tokenization",
    "Tokenizer",
    "WordCache",
    "available_templates",
    "chunk_labels",
    "load_template",
    "load_tokenizer",
    "render",
    "trained_tokens",
]
