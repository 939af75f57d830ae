"""Planning from the input, before any pixel is decoded: ``SampleBuilder.layout`` is the built sample's
length, images, run lengths and vision cost, read from the text and the images' headers;
``neva-pack plan --data_path`` plans exactly what a preprocess run with the same flags packs.

Dynamic family: Qwen2-VL (and OneVision, whose multi-image samples are counted differently) with the
stand-in tokenizer tests/golden/dynamic/tokenizer.json and real photos; fixed: CLIP on sample_data/.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from neva_pack.cli import main
from neva_pack.families import ImageSource, dynamic_image_run, dynamic_processor, resolve_encoder
from neva_pack.commands import explore
from neva_pack.pipeline import DECODE_SKIPS_NOTE, laid_out_lengths
from neva_pack.records import iter_raw_records
from neva_pack.samples import SampleBuilder, Skipped
from neva_pack.text import load_template, load_tokenizer
from tests.conftest import ROOT, SAMPLE_DATA
from tests.image_zoo import MPL, SKIMAGE, random_rgb

GOLDEN_TOKENIZER = ROOT / "tests" / "golden" / "dynamic" / "tokenizer.json"
PHOTOS = ("grace_hopper.jpg", "coffee.png", "chelsea.png", "astronaut.png", "r99x88.png", "r700x60.png")


@pytest.fixture(scope="module")
def dynamic_data(tmp_path_factory):
    """Real photos and synthetic sizes, a tokenizer directory (Qwen2's EOS), and records of one to three
    images, short and long, plus a missing image, a corrupt image body (a valid header) and a
    placeholder mismatch."""
    root = tmp_path_factory.mktemp("dynamic")
    images = root / "images"
    images.mkdir()
    shutil.copy(MPL / "grace_hopper.jpg", images / "grace_hopper.jpg")
    for name in ("coffee.png", "chelsea.png", "astronaut.png"):
        shutil.copy(SKIMAGE / name, images / name)
    for width, height in ((99, 88), (700, 60)):
        random_rgb(width, height, seed=width).save(images / f"r{width}x{height}.png")
    (images / "corrupt.jpg").write_bytes((MPL / "grace_hopper.jpg").read_bytes()[:3000])  # header intact, body cut
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(GOLDEN_TOKENIZER, tokenizer / "tokenizer.json")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    records = []
    for k in range(18):
        names = [PHOTOS[(k + j) % len(PHOTOS)] for j in range(1 + k % 3)]
        question = "".join("<image>\n" for _ in names) + "What is in the picture? " * (1 + k % 4)
        answer = "A photograph of something worth describing at length. " * (1 + 3 * (k % 5))
        records.append(_record(str(k), names, question, answer))
    records.append(_record("missing", ["nope.png"], "<image>\nhi", "hello"))
    records.append(_record("corrupt", ["corrupt.jpg"], "<image>\nhi", "hello"))
    records.append(_record("mismatch", ["coffee.png", "chelsea.png"], "<image>\nhi", "hello"))
    data = root / "data.json"
    data.write_text(json.dumps(records))
    return {"images": images, "tokenizer": tokenizer, "data": data}


def _record(record_id: str, names: list[str], question: str, answer: str) -> dict:
    conversations = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return {"id": record_id, "images": names, "conversations": conversations}


def dynamic_builder(data, encoder_name: str, template: str, max_seq_length: int) -> SampleBuilder:
    tokenizer = load_tokenizer(data["tokenizer"])
    encoder = resolve_encoder(encoder_name)
    return SampleBuilder(
        tokenizer=tokenizer, template=load_template(template, "nemo"), image_source=ImageSource(data["images"]),
        preprocessor=dynamic_processor(encoder), image_run=dynamic_image_run(tokenizer, encoder.family),
        max_seq_length=max_seq_length,
    )  # fmt: skip


def assert_layout_is_the_sample(builder: SampleBuilder, data_path) -> dict[str, int]:
    """Every record's layout against its built sample; returns the decode-only skips (layout kept, build skipped)."""
    decode_only = {}
    for raw in iter_raw_records(data_path, builder.record_limits):
        layout, sample = builder.layout(raw), builder.build(raw)
        if isinstance(layout, Skipped):
            assert isinstance(sample, Skipped)
            assert (layout.reason, layout.detail, layout.index) == (sample.reason, sample.detail, sample.index)
            continue
        if isinstance(sample, Skipped):
            decode_only[raw.record_id] = sample.reason
            continue
        assert layout.index == sample.index and layout.record_id == sample.record_id
        assert layout.length == sample.length and layout.truncated == sample.truncated
        np.testing.assert_array_equal(layout.image_starts, sample.image_starts)
        np.testing.assert_array_equal(layout.image_tokens, sample.image_tokens)
        assert layout.num_images == len(sample.images) and layout.vision_cost == sample.vision_cost
        trained = np.flatnonzero(sample.labels != builder.ignore_index)
        assert layout.first_trained == (trained[0] if len(trained) else sample.length)
    return decode_only


@pytest.mark.parametrize(
    "encoder, template", [("Qwen/Qwen2-VL-7B-Instruct", "qwen2_vl"), ("llava-hf/llava-onevision-qwen2-7b-ov-hf", "qwen_1_5")]
)
@pytest.mark.parametrize("max_seq_length", [40, 700, 2_000, 100_000])
def test_a_dynamic_layout_is_the_built_sample_without_decoding(dynamic_data, encoder, template, max_seq_length):
    builder = dynamic_builder(dynamic_data, encoder, template, max_seq_length)
    decode_only = assert_layout_is_the_sample(builder, dynamic_data["data"])
    assert set(decode_only) <= {"corrupt"}  # only a decode finds a corrupt body
    if max_seq_length == 100_000:
        assert decode_only == {"corrupt": "unreadable_image"}


@pytest.mark.parametrize("max_seq_length", [300, 580, 700, 4096])
def test_a_fixed_layout_is_the_built_sample_without_decoding(sample_dataset, max_seq_length):
    from neva_pack.config import PackConfig, SampleConfig
    from neva_pack.pipeline import sample_builder_for

    sample = SampleConfig(
        data_path=sample_dataset["data_path"], image_folder=sample_dataset["image_folder"],
        tokenizer_path=sample_dataset["tokenizer_path"], conv_template="nvgpt",
    )  # fmt: skip
    builder = sample_builder_for(sample, PackConfig(max_seq_length=max_seq_length))
    assert assert_layout_is_the_sample(builder, sample.data_path) == {}


def test_a_layout_reads_headers_only(dynamic_data):
    """A file with a valid header and no image data behind it is laid out (its count from the header),
    and only the build, which decodes it, skips it."""
    builder = dynamic_builder(dynamic_data, "Qwen/Qwen2-VL-7B-Instruct", "qwen2_vl", 100_000)
    raw = next(r for r in iter_raw_records(dynamic_data["data"]) if r.record_id == "corrupt")
    layout = builder.layout(raw)
    assert layout.num_images == 1 and layout.image_tokens[0] == builder.preprocessor.tokens_for_size(512, 600) + 2
    assert builder.build(raw).reason == "unreadable_image"


@pytest.mark.parametrize("workers", [0, 2])
def test_planned_lengths_are_the_built_samples_and_a_run_cuts_them_the_same(dynamic_data, workers):
    """The plan's per-sample lengths, images, image tokens and vision costs are the built samples' (in
    input order, any number of workers); at a smaller size each sample is cut as the builder cuts."""
    builder = dynamic_builder(dynamic_data, "Qwen/Qwen2-VL-7B-Instruct", "qwen2_vl", 2_000)
    planned = laid_out_lengths(builder, dynamic_data["data"], workers=workers)
    samples = [s for s in map(builder.build, iter_raw_records(dynamic_data["data"])) if not isinstance(s, Skipped)]
    kept = [k for k, s in enumerate(builder.layout(r) for r in iter_raw_records(dynamic_data["data"])) if not isinstance(s, Skipped)]
    assert len(kept) == len(samples) + 1  # the corrupt body: not predicted
    built = dict(zip([s.index for s in samples], samples))
    for position, index in enumerate(kept):
        if index in built:
            sample = built[index]
            assert planned.lengths[position] == sample.length
            assert planned.num_images[position] == len(sample.images)
            assert planned.image_tokens[position] == sample.image_tokens.sum()
            assert planned.vision_cost[position] == sample.vision_cost
    assert planned.skipped_records == {"missing_image": 1, "placeholder_mismatch": 1}
    assert planned.cut_at == 2_000
    rows, skip = planned.laid_out.rows_at(500)
    small = dynamic_builder(dynamic_data, "Qwen/Qwen2-VL-7B-Instruct", "qwen2_vl", 500)
    for position, index in enumerate(kept):
        raw = next(iter_raw_records(dynamic_data["data"], ranges=[(index, index + 1)]))
        again = small.layout(raw)
        if isinstance(again, Skipped):
            assert skip[position] and again.reason == "no_supervised_tokens"
        else:
            assert not skip[position]
            assert (rows["length"][position], rows["num_images"][position], rows["image_tokens"][position]) == (
                again.length, again.num_images, again.image_tokens.sum()
            )


def test_the_plan_from_the_input_is_the_plan_of_a_preprocess_run(sample_dataset, tmp_path, capsys):
    """The same sample flags: the candidate table from the input equals the one from the run's store,
    at sizes that cut (and skip) samples."""
    flags = ["--data_path", str(sample_dataset["data_path"]), "--image_folder", str(sample_dataset["image_folder"]),
             "--tokenizer_path", str(sample_dataset["tokenizer_path"]), "--conv_template", "nvgpt", "--num_workers", "0"]  # fmt: skip
    sizes = ["--pack_sizes", "600", "800", "2048", "--algorithms", "first_fit_decreasing", "near_optimal"]
    out = tmp_path / "out"
    assert main(["preprocess", *flags, *sizes[:4], "--output_dir", str(out), "--quiet"]) == 0
    capsys.readouterr()
    tables = []
    for source in ([str(out)], flags):
        assert main(["plan", *source, *sizes, "--max_images_per_pack", "3", "--json"]) == 0
        tables.append([{k: v for k, v in row.items() if k != "seconds"} for row in json.loads(capsys.readouterr().out)])
    assert tables[0] == tables[1]
    assert any(row["skipped"] for row in tables[0]) and any(row["clipped"] for row in tables[0])


def test_plan_from_the_input_counts_skips_by_reason_and_says_what_it_cannot_predict(sample_dataset, capsys):
    records = json.loads(sample_dataset["data_path"].read_text())
    records[0]["image"] = "not_there.jpg"
    records[1]["conversations"] = records[1]["conversations"][:1]
    sample_dataset["data_path"].write_text(json.dumps(records))
    flags = ["--data_path", str(sample_dataset["data_path"]), "--image_folder", str(sample_dataset["image_folder"]),
             "--tokenizer_path", str(sample_dataset["tokenizer_path"]), "--conv_template", "nvgpt", "--num_workers", "0",
             "--pack_sizes", "4096"]  # fmt: skip
    assert main(["plan", *flags]) == 0
    printed = capsys.readouterr().out
    assert f"{len(records) - 2} samples from {sample_dataset['data_path']}" in printed
    assert "records skipped at every size: missing_image 1, no_assistant_turn 1" in printed
    assert DECODE_SKIPS_NOTE in printed


def test_plan_takes_an_output_or_the_input_not_both(sample_dataset, tmp_path, capsys):
    assert main(["plan", "--pack_sizes", "4096"]) == 2
    assert "give an output directory, or --data_path" in capsys.readouterr().err
    flags = ["--data_path", str(sample_dataset["data_path"]), "--tokenizer_path", str(sample_dataset["tokenizer_path"])]
    assert main(["plan", str(tmp_path), *flags, "--pack_sizes", "4096"]) == 2
    assert "not both" in capsys.readouterr().err


def test_plan_from_the_input_reads_the_hparams_file_as_preprocess_does(sample_dataset, tmp_path, capsys):
    """plan --data_path builds its config as preprocess does: the hparams file's sample settings apply
    (below the flags), its parallel sizes do not (the plan's alignment is its own flags')."""
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("model:\n  context_parallel_size: 4\n  data:\n    conv_template: nvgpt\n")
    flags = ["--data_path", str(sample_dataset["data_path"]), "--image_folder", str(sample_dataset["image_folder"]),
             "--tokenizer_path", str(sample_dataset["tokenizer_path"]), "--num_workers", "0", "--pack_sizes", "600", "2048",
             "--json"]  # fmt: skip
    tables = []
    for extra in (["--hparams_file", str(hparams)], ["--conv_template", "nvgpt"], [], ["--hparams_file", str(hparams), "--conv_template", "plain"]):
        assert main(["plan", *flags, *extra]) == 0
        tables.append([{k: v for k, v in row.items() if k != "seconds"} for row in json.loads(capsys.readouterr().out)])
    assert tables[0] == tables[1] != tables[2] == tables[3]


def test_explore_on_laid_out_samples_honours_image_budgets(dynamic_data):
    builder = dynamic_builder(dynamic_data, "Qwen/Qwen2-VL-7B-Instruct", "qwen2_vl", 4_096)
    planned = laid_out_lengths(builder, dynamic_data["data"])
    budget = int(planned.image_tokens.max())
    (row,) = explore(planned, [4_096], ["first_fit_decreasing"], max_image_tokens_per_pack=budget)
    assert row.skipped == 0 and row.packs >= -(-int(planned.image_tokens.sum()) // budget)
