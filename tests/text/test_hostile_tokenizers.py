"""A Hugging Face tokenizer directory is untrusted: its ``tokenizer.json`` ids and its
``tokenizer_config.json`` specials are checked when it loads. By class, over random edits: any token's id
moved (onto another token's, past the vocabulary, to 2**31 or 2**32 - 1) and any BOS/EOS entry replaced
by a value of any type either loads as a tokenizer whose every id is its own and below its vocabulary
size, with BOS/EOS ids of its vocabulary, or is refused in one line naming the file. And a BOS/EOS that
is an image run's id is refused before any record is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.cli import main
from neva_pack.core import ConfigError
from neva_pack.text import load_tokenizer
from tests.dynamic_references import STAND_IN_TOKENIZER

SPEC = json.loads(STAND_IN_TOKENIZER.read_text())
CONFIG = {"eos_token": "<|im_end|>"}
TOKENS = sorted(SPEC["model"]["vocab"], key=SPEC["model"]["vocab"].get)
IDS = st.one_of(st.integers(0, len(TOKENS) + 5), st.sampled_from([2**24 + 1, 2**31 - 1, 2**31, 2**32 - 1]))
ENTRIES = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**32), st.floats(), st.sampled_from(TOKENS[:12] + ["<nope>", ""]),
                    st.lists(st.sampled_from(TOKENS[:12]), max_size=2),
                    st.fixed_dictionaries({"content": st.one_of(st.sampled_from(TOKENS[:12] + ["<nope>"]), st.integers())}))  # fmt: skip


def write_tokenizer(folder: Path, spec: dict, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def with_id(token: str, new_id: int, spec: dict | None = None) -> dict:
    """The tokenizer (a copy of the stand-in's by default) with ``token``'s id changed where it is written:
    its model's vocabulary and, for an added token, its added_tokens entry (the library takes both as written)."""
    spec = json.loads(json.dumps(SPEC)) if spec is None else spec
    spec["model"]["vocab"][token] = new_id
    for added in spec["added_tokens"]:
        if added["content"] == token:
            added["id"] = new_id
    return spec


@st.composite
def edited_tokenizers(draw) -> tuple[dict, dict]:
    spec, config = json.loads(json.dumps(SPEC)), dict(CONFIG)
    for _ in range(draw(st.integers(0, 2))):
        with_id(draw(st.sampled_from(TOKENS)), draw(IDS), spec)
    for key in draw(st.lists(st.sampled_from(["bos_token", "eos_token"]), max_size=2, unique=True)):
        config[key] = draw(ENTRIES)
    return spec, config


@settings(max_examples=120, deadline=None)
@given(edit=edited_tokenizers())
def test_an_edited_tokenizer_directory_loads_consistent_or_is_one_line_naming_it(tmp_path_factory, edit):
    folder = write_tokenizer(tmp_path_factory.mktemp("tok"), *edit)
    try:
        tokenizer = load_tokenizer(folder)
    except ConfigError as refused:
        message = str(refused)
        assert "\n" not in message and str(folder) in message, message
        return
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    ids = np.array(list(vocab.values()))
    assert len(np.unique(ids)) == len(ids) and ids.max() < tokenizer.vocab_size
    for special in (tokenizer.bos_id, tokenizer.eos_id):
        assert special is None or 0 <= special < tokenizer.vocab_size
    assert tokenizer.encode(" ".join(TOKENS[::97])).ids.max() < tokenizer.vocab_size


@pytest.mark.parametrize("case, says", [
    (with_id("<|im_end|>", 4_000_000_000), "gives '<|im_end|>' the id 4000000000, outside its vocabulary of 1500 ids"),
    (with_id("<|image_pad|>", 600), f"gives {TOKENS[600]!r} and '<|image_pad|>' the same id 600"),
    (with_id("<|image_pad|>", 2), "gives '<|im_end|>' and '<|image_pad|>' the same id 2"),
])  # fmt: skip
def test_ids_past_the_vocabulary_or_shared_are_refused_naming_the_token(tmp_path, case, says):
    """The cases the round found: an id of 4e9 indexed past every table (an IndexError escaped); an image
    pad given a word's or EOS's id made ordinary text read as image positions (the run verified)."""
    with pytest.raises(ConfigError, match="tokenizer.json") as refused:
        load_tokenizer(write_tokenizer(tmp_path, case, CONFIG))
    assert says in str(refused.value)


@pytest.mark.parametrize("entry", [["<|im_end|>"], 2, {"content": 5}, float("nan"), "<nope>"])
def test_a_bos_or_eos_entry_of_another_type_or_not_in_the_vocabulary_is_refused_naming_the_key(tmp_path, entry):
    """Read as 'no EOS' before, every sample lost its end token without a word."""
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: eos_token ") as refused:
        load_tokenizer(write_tokenizer(tmp_path, SPEC, {"eos_token": entry}))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("key", ["bos_token", "eos_token"])
def test_a_bos_or_eos_that_is_an_image_runs_id_is_refused_before_any_record(tmp_path, capsys, key):
    """tokenizer_config.json naming <|image_pad|> its EOS: every turn's end would be an image position
    Qwen2-VL has no pixels for. The run verified before."""
    folder = write_tokenizer(tmp_path / "tok", SPEC, {**CONFIG, key: "<|image_pad|>"})
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}) + "\n")
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--tokenizer_path", str(folder), "--output_dir", str(tmp_path / "out"),
                 "--hf_vision_encoder", "Qwen/Qwen2-VL-7B-Instruct", "--conv_template", "qwen2_vl", "--output_format", "compact",
                 "--num_workers", "0"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    special = key[:3].upper()
    assert f"image_patch_id {SPEC['model']['vocab']['<|image_pad|>']}: also the tokenizer's {special} id" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.meta.json"))


def test_the_stand_in_tokenizer_and_a_copy_of_it_load_unchanged(tmp_path):
    shutil.copy(STAND_IN_TOKENIZER, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(CONFIG))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.vocab_size == len(TOKENS) and tokenizer.eos_id == SPEC["model"]["vocab"]["<|im_end|>"] and tokenizer.bos_id is None
