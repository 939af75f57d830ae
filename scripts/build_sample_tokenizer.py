#!/usr/bin/env python
"""Train the small SentencePiece tokenizer shipped in sample_data/ (sample_data/tokenizer.model).

LLaMA-style (BPE, byte fallback, unk 0, bos 1, eos 2, no pad), with NeMo's special tokens
<extra_id_0> .. <extra_id_9> as user-defined symbols, so NeMo's image layout
(<extra_id_4> patch... <extra_id_5>) applies. Trained only on text this project owns:
the sample conversations and the conversation templates. Deterministic (one thread).

The normaliser and splitting rules are those of the LLaMA-2 / Mistral models (their
tokenizer.model's normalizer_spec and trainer_spec): the "identity" rule, no whitespace
collapsing, the dummy "▁" prefix, digits split one by one, whitespace-only pieces allowed, and no
newline piece (the corpus is split into lines, so a newline is the byte piece <0x0A>, as in those
vocabularies). SentencePiece's default (nmt_nfkc with remove_extra_whitespaces) turns newlines into
spaces and drops trailing whitespace, which no real LLaMA tokenizer does; NeMo and LLaVA compute
their label masks by re-tokenizing pieces of the prompt and adding up lengths, which is exact only
for tokenizers that keep text as it is, so golden files made with such a model would document its
quirks instead of the references' conventions. The text of every template is in the corpus, so
nvgpt's "User" opening a round splits into as many pieces with the dummy prefix as without, as in
LLaMA's large vocabulary (NeMo's nvgpt arithmetic relies on it; trained without nvgpt's text this
model split "▁", "U", "s", "er" against "U", "s", "er" and NeMo's masks drifted a token per round).

    python scripts/build_sample_tokenizer.py
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import sentencepiece
import yaml

ROOT = Path(__file__).resolve().parent.parent
NEMO_SPECIAL_TOKENS = [f"<extra_id_{i}>" for i in range(10)]
VOCAB_SIZE = 1000
CORPUS_TEMPLATES = ("chatml", "llama_2", "llama_3", "mistral", "nvgpt", "plain", "v1", "yi_34b")
"""The templates whose text the model was trained on; fixed, so that adding a template does not
change the shipped model (tests/golden/ pins its sha256)."""


def corpus_lines() -> list[str]:
    records = json.loads((ROOT / "sample_data" / "llava_sample.json").read_text(encoding="utf-8"))
    lines = [turn["value"].replace("<image>", "") for record in records for turn in record["conversations"]]
    for template in sorted(ROOT / "templates" / f"{name}.yaml" for name in CORPUS_TEMPLATES):
        data = yaml.safe_load(template.read_text(encoding="utf-8"))
        for key in ("system", "system_prefix", "system_suffix"):
            if isinstance(data.get(key), str):
                lines.append(data[key])
        for role in ("user", "assistant"):
            for part in (data.get(role) or {}).values():
                lines.append(str(part))
    # one sentence per line: no newline piece, a newline is the byte <0x0A> (as in LLaMA-2/Mistral)
    return [part.strip() for line in lines for part in line.splitlines() if part.strip()]


def main() -> None:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # LLaMA-2 / Mistral: no NFKC, text kept as it is
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        max_sentencepiece_length=16,
        user_defined_symbols=NEMO_SPECIAL_TOKENS,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    out = ROOT / "sample_data" / "tokenizer.model"
    out.write_bytes(model.getvalue())
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    print(f"wrote {out} ({processor.get_piece_size()} pieces)")


if __name__ == "__main__":
    main()
