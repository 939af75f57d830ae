"""Gemma 4 through the public API: token counts equal the processor's ``_get_num_multimodal_tokens`` on more
than 20,000 sizes for every budget; ``pixel_values``, ``image_position_ids`` and ``num_soft_tokens_per_image``
are bit-identical to transformers' ``Gemma4ImageProcessorPil`` over the image zoo, for the settings shipped
for each released instruction-tuned checkpoint (E2B, E4B, 26B-A4B, 31B: one processor block); a preprocess run (the
shipped E2B settings, the gemma4 template, a stand-in tokenizer carrying Gemma 4's special tokens) verifies
and reads back with ``mm_token_type_ids`` in reader items and the Hugging Face batch; nemo and bridge refuse
it, and so does the Megatron THD path (bidirectional image attention); and a tiny random
``Gemma4ForConditionalGeneration`` (float64, ``use_bidirectional_attention="vision"``, sliding and full
layers, sdpa and eager) trained on a packed row through ``hf_collate`` gets the samples' one-by-one loss and
gradients to 1e-9, vision tower included, while rows whose images attend across samples, or whose image
blocks are causal only, move them far more.

Tokenizer: the stand-in tests/golden/dynamic/tokenizer.json with Gemma 4's special tokens added (no Gemma
tokenizer is reachable offline; users bring the real one)."""

from __future__ import annotations

import contextlib
import json
import types

import numpy as np
import pytest
import torch

from neva_pack.cli import main
from neva_pack.commands import verify
from neva_pack.families import dynamic_processor, known_encoders, resolve_encoder, tokens_from_header
from neva_pack.files import paths
from neva_pack.formats import FORMATS, open_packed
from neva_pack.reading import PackedSeqDataset, dynamic_pack_item, sample_of_pack
from neva_pack.text import load_tokenizer
from neva_pack.training import HF_IGNORE_INDEX, MaskSettings, hf_batch, hf_collate, packed_attention_masks, thd_batch, thd_collate
from tests.dynamic_models import TOLERANCE, difference
from tests.dynamic_references import STAND_IN_TOKENIZER
from tests.image_zoo import random_rgb, zoo_images
from tests.family_runs import write_mixed_records

ENCODER = "google/gemma-4-E2B-it"
RELEASED = ("google/gemma-4-E2B-it", "google/gemma-4-E4B-it", "google/gemma-4-26B-A4B-it", "google/gemma-4-31B-it")
"""The instruction-tuned checkpoints whose settings ship (where each was checked: neva_pack/families/shipped/README.md)."""
BUDGETS = (70, 140, 280, 560, 1120)
SPECIALS = ("<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|image>", "<|image|>", "<image|>", "<|video|>", "<|audio|>")
WRONG = 1e-4
TEMPLATE = "gemma4"
"""The gemma4 template by its file: an install maps ``--conv_template gemma4`` to its own checkout's templates."""


def reference_processor(max_soft_tokens: int = 280, encoder: str = ENCODER):
    """transformers' PIL processor built from ``encoder``'s shipped settings (its own reading of each key)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    settings = {k: v for k, v in resolve_encoder(encoder).preprocessor_config.items() if k not in ("image_processor_type", "image_seq_length")}
    return Gemma4ImageProcessorPil(**{**settings, "max_soft_tokens": max_soft_tokens})


def reference_counts(sizes, max_soft_tokens: int, encoder: str = ENCODER) -> list:
    """``Gemma4Processor._get_num_multimodal_tokens`` itself, run on an instance holding only what it
    reads (its image processor; no tokenizer needed), size by size (a ValueError where it raises)."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    holder = types.SimpleNamespace(image_processor=reference_processor(max_soft_tokens, encoder), _merge_kwargs=lambda **kw: {"images_kwargs": {}})
    counts = []
    for width, height in sizes:
        try:
            counts.append(Gemma4Processor._get_num_multimodal_tokens(holder, image_sizes=[(height, width)])["num_image_tokens"][0])
        except ValueError:
            counts.append(ValueError)
    return counts


def ours(family, width, height):
    try:
        return family.tokens_for_size(width, height)
    except ValueError:
        return ValueError


# ---------------------------------------------------------------- settings, counts


@pytest.mark.parametrize("encoder", RELEASED)
def test_the_shipped_settings_are_the_processors_and_name_the_checkpoints(encoder):
    assert set(RELEASED) <= set(known_encoders("gemma4"))
    reference = reference_processor(encoder=encoder)
    spec = resolve_encoder(encoder)
    settings = spec.preprocessor_config
    for key in ("patch_size", "max_soft_tokens", "pooling_kernel_size", "resample", "rescale_factor", "do_normalize"):
        assert getattr(reference, key) == settings[key], key
    assert (spec.name, spec.patch_size, settings["image_seq_length"]) == (encoder, 16, 280)
    assert dynamic_processor(spec).options() == {"max_soft_tokens": 280}


def test_the_four_released_checkpoints_share_one_processor_block():
    """transformers' conversion script writes the same ``Gemma4ImageProcessor`` for every variant (the
    variant picks the model config only), so the four shipped blocks are one, key for key."""
    blocks = [resolve_encoder(encoder).preprocessor_config for encoder in RELEASED]
    assert all(block == blocks[0] for block in blocks[1:])
    assert blocks[0]["image_processor_type"] == "Gemma4ImageProcessor" and blocks[0]["do_normalize"] is False


def size_grid() -> list[tuple[int, int]]:
    """150 x 150 = 22,500 sizes: every side 1..40, then spread to 6,000, with the multiples of 48 and
    their neighbours (where the floor to a side of 48 turns)."""
    sides = sorted(set(range(1, 41)) | {48 * k + d for k in (1, 2, 5, 12, 20) for d in (-1, 0, 1)}
                   | set(np.unique(np.geomspace(41, 6000, 110).astype(int)).tolist()))[:150]  # fmt: skip
    assert len(sides) == 150
    return [(w, h) for w in sides for h in sides]


@pytest.mark.parametrize("encoder", RELEASED)
@pytest.mark.parametrize("budget", BUDGETS)
def test_token_counts_equal_the_processors_on_a_grid_of_sizes(budget, encoder):
    sizes = size_grid()
    family = dynamic_processor(resolve_encoder(encoder), max_soft_tokens=budget)
    expected = reference_counts(sizes, budget, encoder)
    got = [ours(family, w, h) for w, h in sizes]
    assert len(sizes) >= 20_000 and got == expected
    assert ValueError not in expected  # its refusals (0 x 0, over the budget) cannot happen for a real size
    assert max(count for count in got if count is not ValueError) <= budget


def test_a_480_by_640_photo_is_266_tokens_and_the_flag_sets_the_budget(tmp_path):
    family = dynamic_processor(resolve_encoder(ENCODER))
    assert family.tokens_for_size(640, 480) == 266 and family.resized_size(640, 480) == (672, 912)
    random_rgb(640, 480).save(tmp_path / "a.png")
    assert tokens_from_header(tmp_path / "a.png", family) == family.to_uint8(random_rgb(640, 480)).tokens == 266
    assert dynamic_processor(resolve_encoder(ENCODER), max_soft_tokens=1120).tokens_for_size(640, 480) == 1064


def test_a_budget_the_processor_refuses_is_refused_in_one_line():
    from neva_pack.core import ConfigError

    with pytest.raises(ConfigError, match="--max_soft_tokens 100: the processor takes one of 70, 140, 280, 560, 1120"):
        dynamic_processor(resolve_encoder(ENCODER), max_soft_tokens=100)
    with pytest.raises(ConfigError, match="--max_soft_tokens"):
        dynamic_processor(resolve_encoder("Qwen/Qwen3-VL-8B-Instruct"), max_soft_tokens=280)


# ---------------------------------------------------------------- pixels


@pytest.mark.parametrize(("encoder", "budget"), [(ENCODER, 70), (ENCODER, 280), ("google/gemma-4-26B-A4B-it", 280), ("google/gemma-4-31B-it", 140)])
def test_pixels_positions_and_counts_are_bit_identical_to_the_processor_over_the_zoo(encoder, budget):
    family = dynamic_processor(resolve_encoder(encoder), max_soft_tokens=budget)
    theirs = reference_processor(budget, encoder)
    images = zoo_images()
    stored = [family.to_uint8(image) for image in images.values()]
    for (label, image), one in zip(images.items(), stored):
        expected = theirs(images=image, return_tensors="np")
        got = family.model_inputs([one])
        assert got["pixel_values"].dtype == np.float32 and got["pixel_values"].shape == (1, budget * 9, 768), label
        for key in ("pixel_values", "image_position_ids", "num_soft_tokens_per_image"):
            assert np.array_equal(got[key], np.asarray(expected[key])), (label, key)
        assert one.tokens == int(got["num_soft_tokens_per_image"][0]), label
    together = theirs(images=list(images.values()), return_tensors="np")
    got = family.model_inputs(stored)
    for key in ("pixel_values", "image_position_ids", "num_soft_tokens_per_image"):
        assert np.array_equal(got[key], np.asarray(together[key])), key


# ---------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The stand-in tokenizer with Gemma 4's special tokens added; <bos> its BOS, as Gemma's."""
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path_factory.mktemp("gemma4_tok")
    tokenizer = Tokenizer.from_file(str(STAND_IN_TOKENIZER))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}))
    return folder


SIZES = [(120, 90), (300, 200), (60, 400), (512, 288), (640, 480)]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer_dir):
    """A compact run, shipped E2B settings at the 70-token budget, the gemma4 template: records of 0, 1
    and 2 images of several sizes."""
    folder = tmp_path_factory.mktemp("gemma4_run")
    write_mixed_records(folder, SIZES, picture=lambda k, width, height: random_rgb(width, height, seed=k))
    out = folder / "out"
    code = main(["preprocess", "--quiet", "--data_path", str(folder / "data.json"), "--image_folder", str(folder),
                 "--tokenizer_path", str(tokenizer_dir), "--hf_vision_encoder", ENCODER, "--conv_template", TEMPLATE,
                 "--max_soft_tokens", "70", "--output_format", "compact", "--max_seq_length", "400",
                 "--output_dir", str(out)])  # fmt: skip
    assert code == 0
    return out


def test_the_run_verifies_and_records_the_budget(run):
    assert not verify(paths.packed_prefix(run), progress=False).problems
    record = PackedSeqDataset(run).meta.image_processor
    assert (record["family"], record["encoder"], record["max_soft_tokens"]) == ("gemma4", ENCODER, 70)


def test_samples_are_spelled_with_gemma4s_turns_and_image_tokens(run, tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIALS}
    dataset = PackedSeqDataset(run)
    item = next(dataset[p] for p in range(len(dataset)) if int(dataset.sample_images(p).sum()))
    tokens = item["tokens"].tolist()
    first = tokens[: int(item["cu_seqlens_unpadded"][1])]
    assert first[0] == ids["<bos>"] and first[1] == ids["<|turn>"]
    boi, image, eoi = ids["<|image>"], ids["<|image|>"], ids["<image|>"]
    starts = [i for i, t in enumerate(tokens) if t == boi]
    assert starts and all(tokens[i + 1] == image for i in starts)
    assert item["mm_token_type_ids"].tolist() == [int(t == image) for t in tokens]
    assert int(item["num_soft_tokens_per_image"].sum()) == tokens.count(image) and tokens.count(eoi) == len(starts)


def test_an_energon_run_reads_back_the_same_items(run, tokenizer_dir, tmp_path):
    """The energon format holds the same images: its items equal the compact run's, mm_token_type_ids included."""
    folder = run.parent
    code = main(["preprocess", "--quiet", "--data_path", str(folder / "data.json"), "--image_folder", str(folder),
                 "--tokenizer_path", str(tokenizer_dir), "--hf_vision_encoder", ENCODER, "--conv_template", TEMPLATE,
                 "--max_soft_tokens", "70", "--output_format", "energon", "--max_seq_length", "400",
                 "--output_dir", str(tmp_path / "energon")])  # fmt: skip
    assert code == 0
    compact, energon = PackedSeqDataset(run), PackedSeqDataset(tmp_path / "energon")
    assert len(compact) == len(energon)
    for p in range(len(compact)):
        a, b = compact[p], energon[p]
        assert a.keys() == b.keys() and "mm_token_type_ids" in a
        assert all(torch.equal(a[key], b[key]) for key in a), p


@pytest.mark.parametrize("fmt", ["nemo", "bridge"])
def test_nemo_and_bridge_refuse_it_in_one_line_naming_the_formats_that_can(tmp_path, tokenizer_dir, capsys, fmt):
    """NeMo's float crops cannot hold images of their own sizes, and bridge holds text only: both refuse
    before any record is read."""
    random_rgb(64, 64).save(tmp_path / "a.png")
    (tmp_path / "data.json").write_text(json.dumps([{"id": "0", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nHi"}, {"from": "gpt", "value": "Hello"}]}]))  # fmt: skip
    capsys.readouterr()
    code = main(["preprocess", "--quiet", "--data_path", str(tmp_path / "data.json"), "--image_folder", str(tmp_path),
                 "--tokenizer_path", str(tokenizer_dir), "--hf_vision_encoder", ENCODER, "--conv_template", TEMPLATE,
                 "--output_format", fmt, "--output_dir", str(tmp_path / "out")])  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    able = [name for name, other in FORMATS.items() if other.holds_dynamic_images]
    assert code == 2 and len(lines) == 1 and all(name in lines[0] for name in able)


def test_the_thd_path_refuses_it_in_one_line_saying_why(run):
    dataset = PackedSeqDataset(run)
    for attempt in (lambda: thd_collate(dataset), lambda: thd_batch([dataset[0]], with_packed_seq_params=False)):
        with pytest.raises(ValueError, match="bidirectionally inside each image.*THD kernels") as caught:
            attempt()
        assert "\n" not in str(caught.value)


def test_the_hf_batch_needs_the_models_mask_settings(run):
    dataset = PackedSeqDataset(run)
    with pytest.raises(ValueError, match="model_config"):
        hf_collate(dataset)
    with pytest.raises(ValueError, match="masks"):
        hf_batch([dataset[0]])
    with pytest.raises(ValueError, match="flash"):
        MaskSettings.of(types.SimpleNamespace(_attn_implementation="flash_attention_2", layer_types=["full_attention"]))


# ---------------------------------------------------------------- the training proof


def tiny_model(vocab_size: int, ids: dict, implementation: str):
    """A tiny random Gemma4ForConditionalGeneration (float64, seeded): bidirectional attention inside
    images on sliding layers, sliding and full layers alternating with a window of 8 (shorter than the
    samples), per-layer inputs on, a 2-layer vision tower with 16 px patches pooled 3 x 3."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma4Config(
        text_config={"vocab_size": vocab_size, "vocab_size_per_layer_input": vocab_size, "hidden_size": 16,
                     "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 8, "global_head_dim": 8, "hidden_size_per_layer_input": 4, "sliding_window": 8,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                     "use_bidirectional_attention": "vision", "pad_token_id": ids["<pad>"], "bos_token_id": ids["<bos>"],
                     "eos_token_id": ids["<eos>"], "per_layer_config": {}},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "head_dim": 8, "patch_size": 16, "pooling_kernel_size": 3,
                       "position_embedding_size": 256},
        audio_config=None, image_token_id=ids["<|image|>"], boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
        video_token_id=ids["<|video|>"], audio_token_id=ids["<|audio|>"],
    )  # fmt: skip
    config._attn_implementation = implementation
    config.text_config._attn_implementation = implementation
    config.vision_config._attn_implementation = implementation
    return Gemma4ForConditionalGeneration(config).double()


def samples_alone(pack, counts, family, image: int) -> list[tuple[dict, torch.Tensor]]:
    """(model inputs, targets) of each sample of a read pack alone, unpadded, as the processor's output
    would feed the model: it builds its own mask from ``mm_token_type_ids``."""
    runs = []
    for k in range(len(counts)):
        item = dynamic_pack_item(sample_of_pack(pack, counts, k), counts[k : k + 1], family, image)
        length = int(item["cu_seqlens_unpadded"][-1])
        ids = item["tokens"][:length][None]
        batch = {"input_ids": ids, "mm_token_type_ids": (ids == image).long()}
        if int(item["num_images"].sum()):
            batch.update(pixel_values=item["pixel_values"], image_position_ids=item["image_position_ids"])
        targets = item["labels"][:length]
        runs.append((batch, torch.where(targets < 0, HF_IGNORE_INDEX, targets)))
    return runs


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def proof(request, run, tokenizer_dir):
    """Packs of the run holding several images in several samples, as one ``hf_collate`` row, and the loss
    and gradients of their samples one by one."""
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIALS}
    model = tiny_model(tokenizer.vocab_size, ids, request.param)
    dataset, reader, image = PackedSeqDataset(run), open_packed(run), ids["<|image|>"]
    packs = [p for p in range(len(dataset)) if dataset.sample_images(p).sum() and len(dataset.sample_images(p)) > 1][:2]
    assert sum(int(dataset.sample_images(p).sum()) for p in packs) >= 2
    batch = hf_collate(dataset, image, model_config=model.config, mask_dtype=torch.float64)([dataset[p] for p in packs])
    alone = [one for p in packs for one in samples_alone(reader.pack(p), dataset.sample_images(p), dataset.processor, image)]
    return model, batch, batch["shift_labels"][0], loss_and_gradients(model, alone)


MODEL_KEYS = ("input_ids", "position_ids", "pixel_values", "image_position_ids", "mm_token_type_ids", "attention_mask")
"""What the model reads of a batch (the masks too, where the batch carries them)."""


@contextlib.contextmanager
def float64_throughout():
    """Gemma 4's modelling casts to float32 in places (its RMSNorm, the eager softmax, the vision pooling):
    in a float64 model those islands round gradients summed over tokens to float32 (~1e-7 relative, in
    an order that differs between a row and its samples). Kept float64 here, for both sides, so that
    what is compared is the masking and the batching, at 1e-9; the forward pass is bit-identical either way."""
    original_float, original_softmax = torch.Tensor.float, torch.nn.functional.softmax

    def keep_float64(tensor, *args, **kwargs):
        return tensor.double(*args, **kwargs)

    def softmax(input, *args, dtype=None, **kwargs):
        return original_softmax(input, *args, dtype=None if input.dtype == torch.float64 else dtype, **kwargs)

    torch.Tensor.float, torch.nn.functional.softmax = keep_float64, softmax
    try:
        yield
    finally:
        torch.Tensor.float, torch.nn.functional.softmax = original_float, original_softmax


def loss_and_gradients(model, runs: list[tuple[dict, torch.Tensor]]) -> tuple[float, dict]:
    """The summed trained-target cross-entropy of ``runs`` and every parameter's gradient of it."""
    with float64_throughout():
        return _loss_and_gradients(model, runs)


def _loss_and_gradients(model, runs):
    import torch.nn.functional as F

    model.zero_grad()
    total = 0
    for batch, targets in runs:
        inputs = {key: batch[key] for key in MODEL_KEYS if key in batch}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].double()
        logits = model(**inputs, use_cache=False).logits[0]
        total = total + F.cross_entropy(logits, targets.clamp(min=0), reduction="none").where(targets != HF_IGNORE_INDEX, 0).sum()
    total.backward()
    return float(total.detach()), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def packed_loss(model, batch, targets):
    return loss_and_gradients(model, [(batch, targets)])


def test_a_tiny_gemma4_trained_on_a_packed_row_through_hf_collate_gets_the_samples_loss_and_gradients(proof):
    model, batch, targets, reference = proof
    assert batch["mm_token_type_ids"].shape == batch["input_ids"].shape and set(batch["attention_mask"]) == {"sliding_attention", "full_attention"}
    assert len(torch.unique(torch.tensor([0] + batch["cu_seq_lens_q"].tolist()))) > 2  # several samples in the row
    assert any(name.startswith("model.vision_tower") for name in reference[1])  # the vision tower is trained
    assert difference(packed_loss(model, batch, targets), reference) < TOLERANCE


def test_rows_whose_images_leave_their_sample_or_stay_causal_fail_clearly(proof):
    model, batch, targets, reference = proof
    settings = MaskSettings.of(model.config, torch.float64)
    marks, bounds = batch["mm_token_type_ids"][0], batch["cu_seq_lens_q"]
    # image blocks causal only: no layer opens them
    causal = packed_attention_masks(bounds, marks, (), settings)
    assert difference(packed_loss(model, {**batch, "attention_mask": causal}, targets), reference) > WRONG
    # an image attending across samples: the image tokens after the first sample also see the first sample
    leaking = {key: mask.clone() for key, mask in batch["attention_mask"].items()}
    first_end = int(bounds[1])
    later_images = torch.nonzero(marks.bool() & (torch.arange(len(marks)) >= first_end))[:, 0]
    assert len(later_images)
    for mask in leaking.values():
        mask[0, 0, later_images, :first_end] = 0
    assert difference(packed_loss(model, {**batch, "attention_mask": leaking}, targets), reference) > WRONG
    # the model's own mask from positions and mm_token_type_ids: on a packed row it reads other samples' blocks
    own = {key: value for key, value in batch.items() if key != "attention_mask"}
    assert difference(packed_loss(model, own, targets), reference) > WRONG
