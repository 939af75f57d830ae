#!/usr/bin/env python
"""Train the small byte-level BPE tokenizer the dynamic-resolution tests use
(tests/golden/dynamic/tokenizer.json): a stand-in for the Qwen2 / Qwen2-VL and LLaVA-NeXT tokenizers,
which cannot be downloaded here, carrying their real special tokens.

Qwen2's layout: NFC normaliser, its pre-tokenizer regex then byte-level bytes, byte-level decoder, no
unknown token. Added special tokens, as the models' tokenizers spell them: Qwen2's ``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>``, Qwen2-VL's ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
``<|video_pad|>``, LLaVA-NeXT / OneVision's ``<image>``, and LLaMA's ``<s>`` / ``</s>`` (so one file
serves every template; each test names its BOS/EOS in a tokenizer_config.json). Trained only on text this
project owns (the sample conversations and the templates); deterministic.

    python scripts/build_dynamic_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden" / "dynamic" / "tokenizer.json"
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>", "<image>", "<s>", "</s>",
]  # fmt: skip
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
VOCAB_SIZE = 1500


def corpus() -> list[str]:
    records = json.loads((ROOT / "sample_data" / "llava_sample.json").read_text(encoding="utf-8"))
    texts = [turn["value"] for record in records for turn in record["conversations"]]
    texts += [path.read_text(encoding="utf-8") for path in sorted((ROOT / "templates").glob("*.yaml"))]
    return texts


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    build().save(str(OUT), pretty=False)
    print(f"wrote {OUT}")
