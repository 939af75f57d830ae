"""Shared fixtures: real tokenizers (sample_data's own, Mistral v0.1 from mistral-common,
a Hugging Face tokenizer directory built here) and the bundled sample dataset."""

from __future__ import annotations

import importlib.resources
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("neva_pack", deadline=None)
settings.load_profile("neva_pack")
"""Property tests judge results, never speed: a busy 2-core CI machine must not fail them on time
(numba compiles on a first call; speed goals are met in benchmarks/)."""

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATA = ROOT / "sample_data"


def _use_this_checkouts_templates() -> None:
    """``neva_pack.yaml_templates`` (pyproject's name for templates/) is this checkout's folder. An editable
    install made from another checkout maps the name to that checkout's templates/, so a template added
    here would be "unknown" to the tests of this checkout (PYTHONPATH finds neva_pack here, the mapped
    name there)."""
    import importlib.util
    import sys

    folder = ROOT / "templates"
    try:
        if Path(str(importlib.resources.files("neva_pack.yaml_templates"))).resolve() == folder.resolve():
            return
    except ModuleNotFoundError:  # no install at all: the checkout's folder is the only one
        pass
    spec = importlib.util.spec_from_file_location(
        "neva_pack.yaml_templates", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["neva_pack.yaml_templates"] = module


_use_this_checkouts_templates()


@pytest.fixture(scope="session")
def sample_tokenizer_path() -> Path:
    """The project's own SentencePiece model (LLaMA-style, with NeMo's <extra_id_0..9>)."""
    return SAMPLE_DATA / "tokenizer.model"


@pytest.fixture(scope="session")
def mistral_tokenizer_path() -> Path:
    """Mistral-7B v0.1 SentencePiece (vocab 32000, bos 1, eos 2, byte fallback), Apache-2.0."""
    return Path(str(importlib.resources.files("mistral_common") / "data" / "tokenizer.model.v1"))


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> Path:
    """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json) with ChatML
    specials, trained here on the sample conversations: exercises the `tokenizers` backend."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    records = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
    texts = [t["value"] for r in records for t in r["conversations"]] + ["système, naïve café ünïcode"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return directory


@pytest.fixture()
def sample_dataset(tmp_path) -> dict:
    """A writable copy of sample_data/ (records, images, tokenizer)."""
    target = tmp_path / "sample_data"
    shutil.copytree(SAMPLE_DATA, target)
    return {
        "data_path": target / "llava_sample.json",
        "image_folder": target / "images",
        "tokenizer_path": target / "tokenizer.model",
        "root": target,
    }


@pytest.fixture(scope="session")
def workloads(tmp_path_factory):
    """The seeded workloads the golden checksums were computed on (60 image records, 300 text-only)."""
    from benchmarks.workloads import image_workload, text_workload

    root = tmp_path_factory.mktemp("workloads")
    image = image_workload(root / "image", 60, seed=1)
    return {
        "image": ["--data_path", image["data_path"], "--image_folder", image["image_folder"]],
        "text": ["--data_path", text_workload(root / "text.json", 300, seed=2)],
    }
