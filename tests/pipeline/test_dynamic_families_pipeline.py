"""LLaVA-NeXT (v1.6 vicuna and mistral) and LLaVA-OneVision runs end to end: records with photos and
synthetic sizes, one- and several-image samples and text-only ones, from the command line to a
compact output that verifies; its ``PackedSeqDataset`` items (processor from the meta) hold each
sample's ids as transformers' LlavaNextProcessor / LlavaOnevisionProcessor expand its prompt, and the
pack's ``pixel_values`` / ``image_sizes`` as the PIL image processors give them for the same images.
With ``--tokenization llava`` every image's run is LLaVA's own ``llava_arch`` count (which differs from
transformers' for small images): the reference ids with each run at that length."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from neva_pack.cli import main
from neva_pack.reading import PackedSeqDataset
from neva_pack.families import dynamic_processor, resolve_encoder
from neva_pack.formats import open_packed
from neva_pack.files import packed_prefix
from neva_pack.text import load_tokenizer
from neva_pack.commands import verify
from tests.dynamic_references import (
    anyres_reference,
    llava_prompt,
    reference_ids,
    stand_in_tokenizer,
)
from tests.image_zoo import MPL, SKIMAGE, random_rgb

V16_VICUNA = "llava-hf/llava-v1.6-vicuna-7b-hf"
V16_MISTRAL = "llava-hf/llava-v1.6-mistral-7b-hf"
OV = "llava-hf/llava-onevision-qwen2-7b-ov-hf"
CONVERSATIONS = [
    (("Who is this?", ["grace_hopper.jpg"]), "Grace Hopper.", ("And now?", []), "Still her."),
    (("No image here.", []), "Then text only."),
    (("Read it.", ["text.png"]), "Some text."),
    (("Compare.", ["coffee.png", "r99x88.png"]), "A cup and some noise."),
    (("Tiny?", ["r30x40.png"]), "Yes."),
]
"""Samples of one image (photos; 99 x 88 and 30 x 40, where LLaVA's arithmetic and transformers' disagree),
of two, and of none."""


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava_runs")
    (folder / "img").mkdir()
    shutil.copy(MPL / "grace_hopper.jpg", folder / "img" / "grace_hopper.jpg")
    for name in ("coffee.png", "text.png"):
        shutil.copy(SKIMAGE / name, folder / "img" / name)
    for width, height in ((99, 88), (30, 40)):
        random_rgb(width, height, seed=width).save(folder / "img" / f"r{width}x{height}.png")
    for kind in ("qwen", "llama"):
        (folder / kind).mkdir()
        stand_in_tokenizer(folder / kind, kind)
    records = []
    for k, turns in enumerate(CONVERSATIONS):
        conversations = [{"from": "gpt", "value": turn} if j % 2 else
                         {"from": "human", "value": "".join("<image>\n" for _ in turn[1]) + turn[0]} for j, turn in enumerate(turns)]  # fmt: skip
        names = [name for turn in turns[::2] for name in turn[1]]
        records.append({"id": str(k), "conversations": conversations, **({"image": names} if names else {})})
    (folder / "data.json").write_text(json.dumps(records))
    return folder


CASES = [
    pytest.param(V16_VICUNA, "vicuna_v1", "llama", "nemo", id="v16_vicuna"),
    pytest.param(V16_VICUNA, "vicuna_v1", "llama", "llava", id="v16_vicuna_llava_arithmetic"),
    pytest.param(V16_MISTRAL, "mistral_instruct", "llama", "nemo", id="v16_mistral"),
    pytest.param(OV, "qwen_1_5", "qwen", "nemo", id="onevision"),
]


@pytest.mark.parametrize("encoder_name, template, kind, tokenization", CASES)
def test_a_llava_next_or_onevision_run_reads_back_as_the_reference_processors_give_it(
    workload, tmp_path, encoder_name, template, kind, tokenization
):  # fmt: skip
    assert main(["preprocess", "--quiet", "--data_path", str(workload / "data.json"), "--image_folder", str(workload / "img"),
                 "--tokenizer_path", str(workload / kind), "--hf_vision_encoder", encoder_name, "--conv_template", template,
                 "--tokenization", tokenization, "--output_format", "compact", "--max_seq_length", "8192",
                 "--output_dir", str(tmp_path), "--num_workers", "0"]) == 0  # fmt: skip
    assert verify(packed_prefix(tmp_path), progress=False).ok
    reader = open_packed(tmp_path)
    arithmetic = "llava" if tokenization == "llava" else "transformers"
    assert reader.meta.image_processor["arithmetic"] == arithmetic and reader.meta.counts.skipped == 0
    table = reader.plan_table()
    dataset = PackedSeqDataset(tmp_path)
    ours = dynamic_processor(resolve_encoder(encoder_name), arithmetic=arithmetic)
    reference = anyres_reference(workload / kind, encoder_name)
    image_id = load_tokenizer(workload / kind).token_to_id("<image>")
    onevision = encoder_name == OV
    seen, compared = set(), 0
    for p in range(len(dataset)):
        item = dataset[p]
        records = table.record_index[table.offsets[p] : table.offsets[p + 1]].tolist()
        bounds = item["cu_seqlens"].tolist()
        pictures = []
        for k, index in enumerate(records):
            turns = CONVERSATIONS[index]
            names = [name for turn in turns[::2] for name in turn[1]]
            expected = reference_ids(reference, llava_prompt(template, tokenization, turns), names, workload / "img")
            if tokenization == "llava":  # each run at LLaVA's own count for its image
                runs = [ours.tokens_for_size(*size) for size in image_sizes(workload / "img", names)]
                expected = with_runs(expected, image_id, runs)
            start, end = bounds[k], bounds[k + 1]
            np.testing.assert_array_equal(item["tokens"][start:end].numpy(), expected[:-1])
            assert int(item["labels"][end - 1]) == expected[-1]
            pictures.append(load(workload / "img", names))
            seen.add(index)
        pictures = [images for images in pictures if images]
        if not pictures:
            assert len(item["pixel_values"]) == 0
            continue
        # OneVision: each sample's images together (several: each one untiled); LLaVA-NeXT: one by one
        processed = reference.image_processor(pictures if onevision else [image for images in pictures for image in images], return_tensors="np")
        assert item["pixel_values"].numpy().dtype == np.float32
        assert np.array_equal(item["pixel_values"].numpy(), processed["pixel_values"])
        assert np.array_equal(item["image_sizes"].numpy(), processed["image_sizes"])
        compared += len(processed["pixel_values"])
    assert seen == set(range(len(CONVERSATIONS))) and compared == 5
    if tokenization == "llava":  # the arithmetic is LLaVA's: not transformers' count at these sizes
        transformers_count = dynamic_processor(resolve_encoder(encoder_name)).tokens_for_size
        assert ours.tokens_for_size(99, 88) != transformers_count(99, 88) and ours.tokens_for_size(30, 40) != transformers_count(30, 40)


def load(folder, names):
    from PIL import Image

    return [Image.open(folder / name).convert("RGB") for name in names]


def image_sizes(folder, names) -> list[tuple[int, int]]:
    from PIL import Image

    sizes = []
    for name in names:
        with Image.open(folder / name) as image:
            sizes.append(image.size)
    return sizes


def with_runs(ids: np.ndarray, image_id: int, runs: list[int]) -> np.ndarray:
    """``ids`` with its k-th run of ``image_id`` made ``runs[k]`` long."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], (ids == image_id).astype(np.int8), [0]])))
    starts, ends = edges[::2], edges[1::2]
    assert len(starts) == len(runs)
    pieces, position = [], 0
    for start, end, run in zip(starts, ends, runs):
        pieces += [ids[position:start], np.full(run, image_id, dtype=ids.dtype)]
        position = end
    return np.concatenate([*pieces, ids[position:]])
