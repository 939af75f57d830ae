"""Hostile inputs, the shared harness: three good records with one hostile record among them
(built in a tmp dir), a run of the command line over them, and what it left.

A run must exit as stated, skip the hostile record with its reason (or refuse the run with one
line), and leave an output that ``neva-pack verify OUT --data_path DATA`` accepts. The tests are by
subject under the package each one specifies (records/test_hostile_records.py, families/,
samples/, pipeline/, cli/, config/, commands/)."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from neva_pack.cli import main
from neva_pack.commands import verify
from neva_pack.files import skipped_path
from tests.conftest import SAMPLE_DATA

TOKENIZER = SAMPLE_DATA / "tokenizer.model"


def conversation(question="What is shown?", answer="A cat."):
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


GOOD = [
    {"id": "good0", "conversations": conversation("Hi there", "Hello!")},
    {"id": "good1", "image": "chelsea.jpg", "conversations": conversation("<image>\nWhat is this?", "A cat.")},
    {"id": "good2", "conversations": conversation("Name a colour.", "Blue.")},
]
HOSTILE_AT = 1
"""The hostile record's index: records are read on after it."""


@dataclass
class Run:
    code: int
    out: Path
    data: Path
    err: str
    reasons: dict[int, str]
    """Skipped record index -> reason."""

    @property
    def verified(self) -> bool:
        result = verify(self.out, data_path=self.data, progress=False)
        assert result.ok, result.problems
        return True


@pytest.fixture()
def images(tmp_path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(SAMPLE_DATA / "images" / "chelsea.jpg", folder)
    return folder


def text_of(record) -> str:
    return record if isinstance(record, str) else json.dumps(record)


def write_data(path: Path, records, fmt: str) -> Path:
    texts = [text_of(r) for r in records]
    path.write_text("\n".join(texts) + "\n" if fmt == "jsonl" else "[\n" + ",\n".join(texts) + "\n]\n", encoding="utf-8")
    return path


def run_with(tmp_path, capsys, images, hostile, *extra, fmt="jsonl") -> Run:
    records = GOOD[:HOSTILE_AT] + [hostile] + GOOD[HOSTILE_AT:]
    data = write_data(tmp_path / f"data.{fmt}", records, fmt)
    return run_on(tmp_path, capsys, data, images, *extra)


def run_on(tmp_path, capsys, data, images, *extra) -> Run:
    out = tmp_path / "out"
    code = main(["preprocess", "--quiet", "--data_path", str(data), "--image_folder", str(images),
                 "--tokenizer_path", str(TOKENIZER), "--output_dir", str(out), "--conv_template", "v1",
                 "--num_workers", "0", *extra])  # fmt: skip
    err = capsys.readouterr().err
    reasons = {}
    if skipped_path(out).is_file():
        reasons = {line["index"]: line["reason"] for line in map(json.loads, skipped_path(out).read_text().splitlines())}
    return Run(code, out, data, err, reasons)


def png_bytes(width: int, height: int, mode: str = "RGB", array=None) -> bytes:
    image = Image.fromarray(array) if array is not None else Image.new(mode, (width, height))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def image_record(name: str) -> dict:
    return {"id": "hostile", "image": name, "conversations": conversation("<image>\nWhat is this?", "Nothing.")}


def adjacent_images_record() -> dict:
    return {"id": "two", "image": ["chelsea.jpg", "chelsea.jpg"],
            "conversations": conversation("Hi", "Hello.") + conversation("<image><image>\nAnd these?", "Cats.")}  # fmt: skip


def skip_detail(run: Run, index: int = HOSTILE_AT) -> str:
    return next(line["detail"] for line in map(json.loads, skipped_path(run.out).read_text().splitlines())
                if line["index"] == index)  # fmt: skip


class NoCapture:
    """capsys for a hypothesis example (a function-scoped fixture cannot be used across examples)."""

    @staticmethod
    def readouterr():
        return Captured("")


@dataclass
class Captured:
    err: str
