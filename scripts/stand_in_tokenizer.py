#!/usr/bin/env python
"""Write a stand-in tokenizer directory for running a model family offline, before its real
tokenizer is at hand (a laptop without the checkpoint, a docs example, a CI job).

    python scripts/stand_in_tokenizer.py OUT_DIR --special TOKEN ... --eos TOKEN [--bos TOKEN] [--pad TOKEN]

OUT_DIR gets ``tokenizer.json`` (the small byte-level BPE of tests/golden/dynamic/tokenizer.json, which
already spells Qwen2's chat and vision tokens, LLaVA-NeXT's ``<image>`` and LLaMA's ``<s>``/``</s>``,
plus every ``--special`` token added as a special token) and ``tokenizer_config.json`` naming its
BOS/EOS/PAD. Each family's docs page gives the exact command with that family's image and chat tokens.

The ids in a pack made with it are the stand-in's, not the model's: use it to try a command, check a
dataset (skips, lengths, ``neva-pack plan``), or test a pipeline, then run again with the model's own
tokenizer directory to train. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

BASE = Path(__file__).resolve().parent.parent / "tests" / "golden" / "dynamic" / "tokenizer.json"


def write_stand_in(out: Path, specials: list[str], eos: str, bos: str | None = None, pad: str | None = None) -> Path:
    """The stand-in tokenizer directory ``out``: BASE with ``specials`` (and the BOS/EOS/PAD tokens) added."""
    tokenizer = Tokenizer.from_file(str(BASE))
    named = [token for token in (bos, eos, pad) if token is not None]
    wanted = [token for token in dict.fromkeys([*specials, *named]) if tokenizer.token_to_id(token) is None]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in wanted])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"eos_token": eos} | ({"bos_token": bos} if bos else {}) | ({"pad_token": pad} if pad else {})
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the tokenizer directory to write")
    parser.add_argument("--special", nargs="*", default=[], help="tokens to add as special tokens (the model's image run, chat markers)")
    parser.add_argument("--eos", required=True, help="the EOS token the template ends a turn with")
    parser.add_argument("--bos", default=None)
    parser.add_argument("--pad", default=None)
    args = parser.parse_args()
    out = write_stand_in(args.out, args.special, args.eos, args.bos, args.pad)
    print(f"wrote {out}/tokenizer.json and tokenizer_config.json (a stand-in: its ids are not the model's)")


if __name__ == "__main__":
    main()
