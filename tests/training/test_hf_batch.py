"""hf_batch: Hugging Face flattened rows, proven on real transformers models.

Tiny randomly initialised models (CPU, float64, sdpa), built here from configs (no hub): a packed row
must give the same summed loss and gradients as its samples one by one, and the wrong variants
(positions that do not restart, targets shifted twice, images out of order) must not. The packs
come from a real preprocess of sample_data (compact format, CLIP-336: 576 positions per image);
the layout tests use hand-made packs.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neva_pack.cli import main
from neva_pack.reading import PackedSamples, PackedSeqDataset
from neva_pack.training import PackedBatchSampler, hf_batch, hf_collate
from tests.conftest import SAMPLE_DATA

EXACT = 1e-9


def item(samples, images=(), padded=None, image_shape=(3, 2, 2)):
    """A PackedSeqDataset item from (tokens, labels) lists; ``padded`` gives each sample's buffer size
    (alignment padding: pad id 0, label -1)."""
    tokens, labels, real, sizes = [], [], [], []
    for k, (sample_tokens, sample_labels) in enumerate(samples):
        size = len(sample_tokens) if padded is None else padded[k]
        extra = size - len(sample_tokens)
        tokens += [*sample_tokens, *[0] * extra]
        labels += [*sample_labels, *[-1] * extra]
        real.append(len(sample_tokens))
        sizes.append(size)
    num_images = [len(per_sample) for per_sample in images] if images else [0] * len(samples)
    pictures = [torch.full(image_shape, float(v)) for per_sample in images for v in per_sample]
    cumulate = lambda values: torch.tensor(np.concatenate([[0], np.cumsum(values)]), dtype=torch.int32)  # noqa: E731
    return {
        "cu_seqlens": cumulate(sizes),
        "cu_seqlens_unpadded": cumulate(real),
        "tokens": torch.tensor(tokens),
        "labels": torch.tensor(labels),
        "image": torch.stack(pictures) if pictures else torch.zeros((1, *image_shape)),
        "num_images": torch.tensor(num_images, dtype=torch.int32),
    }


def test_a_row_is_the_picture_of_the_module_docstring():
    """a = [10, 11, 12] trains on its last two targets, b = [20, 21] on both."""
    batch = hf_batch([item([([10, 11, 12], [-1, 12, 13]), ([20, 21], [21, 22])])])
    assert batch["input_ids"].tolist() == [[10, 11, 12, 20, 21]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["shift_labels"].tolist() == [[-100, 12, 13, 21, 22]]
    assert batch["labels"].tolist() == [[-100, -100, 12, -100, 21]]  # each sample's first position ignored
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 5]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 3 and isinstance(batch["max_length_q"], int)
    assert "pixel_values" not in batch


def test_packs_are_laid_end_to_end_and_padding_stays_in_its_sample():
    first = item([([1, 2, 3], [2, 3, 4]), ([5], [6])], padded=[4, 4])
    second = item([([7, 8], [8, 9])])
    batch = hf_batch([first, second])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 5, 0, 0, 0, 7, 8]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 8, 10] and batch["max_length_q"] == 4
    assert batch["shift_labels"].tolist() == [[2, 3, 4, -100, 6, -100, -100, -100, 8, 9]]
    assert batch["labels"].tolist() == [[-100, 2, 3, 4, -100, 6, -100, -100, -100, 8]]


@pytest.mark.parametrize("run", [[7, 0, 0, 8], [0, 0, 0, 0], [7, 0, 0, 0], [0, 0, 0, 8]])
def test_image_runs_become_the_image_token_and_pixels_come_in_placeholder_order(run):
    """Runs with start and end ids, patches only, start only, end only; a text token equal to the
    patch id (0) stays text when the run has its own delimiter."""
    text = [0, 3] if run[0] != 0 or run[-1] != 0 else [3, 4]
    first = item([(text + run, [-1] * 6), ([5] + run + run, [-1] * 9)], images=[(1,), (2, 3)])
    second = item([([6, 6], [-1, -1])])  # no images: its zero image is left out
    batch = hf_batch([first, second, item([(run + [9], [-1] * 5)], images=[(4,)])], image_token_id=99, image_run=np.array(run))
    expected = text + [99] * 4 + [5] + [99] * 8 + [6, 6] + [99] * 4 + [9]
    assert batch["input_ids"][0].tolist() == expected
    assert batch["pixel_values"][:, 0, 0, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    untouched = hf_batch([first], image_token_id=None)
    assert untouched["input_ids"][0, :6].tolist() == text + run


def test_a_pack_whose_runs_do_not_match_its_images_is_refused():
    pack = item([([7, 0, 8, 3], [-1] * 4)], images=[(1, 2)])
    with pytest.raises(ValueError, match="2 images holds 1 whole image runs"):
        hf_batch([pack], image_token_id=99, image_run=np.array([7, 0, 8]))
    with pytest.raises(ValueError, match="needs image_run"):
        hf_batch([pack], image_token_id=99)
    with pytest.raises(ValueError, match="not a whole number"):
        hf_batch([item([([0, 0, 0, 3], [-1] * 4)], images=[(1,)])], image_token_id=99, image_run=np.array([0, 0]))


# --- real models on the packs of a real preprocess ------------------------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """sample_data preprocessed (20 conversations, 2048-position packs, 4 of them with images)."""
    output = tmp_path_factory.mktemp("hf")
    args = [
        "preprocess", "--quiet", "--data_path", SAMPLE_DATA / "llava_sample.json",
        "--image_folder", SAMPLE_DATA / "images", "--tokenizer_path", SAMPLE_DATA / "tokenizer.model",
        "--output_dir", output, "--conv_template", "v1", "--max_seq_length", 2048, "--num_workers", 0,
        "--output_format", "compact",
    ]  # fmt: skip
    assert main(list(map(str, args))) == 0
    return PackedSeqDataset(output, dtype=torch.float64)


def llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.3, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def llava(vocab_size: int, image_token_id: int):
    """CLIP-336/14 vision tower (576 patch features per image, the class token dropped), Llama text."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    text = LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.3,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        image_size=336, patch_size=14, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token_id,
        vision_feature_layer=-1, vision_feature_select_strategy="default",
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlavaForConditionalGeneration(config).double()


def summed_loss_and_grads(model, batch):
    """Summed next-token cross entropy in float64 (what ForCausalLMLoss computes from shift_labels,
    without its float32 upcast) and the gradients of every parameter, flattened."""
    model.zero_grad()
    inputs = {key: batch[key] for key in ("input_ids", "position_ids", "pixel_values") if key in batch}
    logits = model(**inputs, use_cache=False).logits
    loss = F.cross_entropy(logits[0], batch["shift_labels"][0], ignore_index=-100, reduction="sum")
    loss.backward()
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])
    return loss.detach(), grads


def one_by_one(model, collate, samples, indices):
    losses, grads = zip(*(summed_loss_and_grads(model, collate([samples[j]])) for j in indices))
    return sum(losses), sum(grads)


def relative(value, reference):
    return float(torch.linalg.norm(value - reference) / torch.linalg.norm(reference))


def samples_of(samples: PackedSamples, packs: list[int]) -> list[int]:
    return [j for p in packs for j in range(int(samples.offsets[p]), int(samples.offsets[p + 1]))]


@pytest.fixture(scope="module")
def text_model(packed):
    return llama(packed.meta.vocab_size)


@pytest.fixture(scope="module")
def image_model(packed):
    return llava(packed.meta.vocab_size + 1, image_token_id=packed.meta.vocab_size)


@pytest.fixture(scope="module")
def text_row(packed, text_model):
    """Packs 0 and 1 as one row, and the float64 loss and gradients of their samples one by one."""
    collate, samples = hf_collate(packed), PackedSamples(packed)
    expected_loss, expected_grads = one_by_one(text_model, collate, samples, samples_of(samples, [0, 1]))
    return collate([packed[0], packed[1]]), expected_loss, expected_grads


def test_llama_loss_and_gradients_on_packs_equal_the_samples_one_by_one(text_model, text_row):
    batch, expected_loss, expected_grads = text_row
    loss, grads = summed_loss_and_grads(text_model, batch)
    assert abs(loss - expected_loss) <= EXACT * abs(expected_loss)
    assert relative(grads, expected_grads) <= EXACT


def test_hugging_face_own_loss_uses_shift_labels_as_given_and_counts_every_target(packed, text_model, text_row):
    """ForCausalLMLoss (float32 inside) on the whole batch dict equals the float64 sum to float32
    precision; the Trainer's num_items_in_batch (shift_labels != -100) is every trained target."""
    batch, expected, _ = text_row
    hf_loss = text_model(**batch, use_cache=False, num_items_in_batch=1).loss.detach()
    assert abs(float(hf_loss) - float(expected)) <= 1e-6 * abs(float(expected))
    trained = sum(int((packed[p]["labels"] != packed.meta.ignore_index).sum()) for p in (0, 1))
    assert int(batch["shift_labels"].ne(-100).sum()) == trained


def test_wrong_rows_fail_by_a_clear_margin(text_model, text_row):
    batch, expected, expected_grads = text_row
    positions = dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1])[None])  # one long sequence
    loss, grads = summed_loss_and_grads(text_model, positions)
    assert abs(loss - expected) > 1e-4 * abs(expected) and relative(grads, expected_grads) > 1e-3
    # our targets handed to a loss that shifts them again (as labels, without shift_labels)
    twice = text_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["shift_labels"],
                       use_cache=False, num_items_in_batch=1).loss.detach()  # fmt: skip
    assert abs(float(twice) - float(expected)) > 1e-4 * abs(float(expected))


def test_llava_loss_and_gradients_on_image_packs_equal_the_samples_one_by_one(packed, image_model):
    """A pack whose samples hold 1, 2 and 0 images (CLIP-336 tower, 576 features per image)."""
    collate = hf_collate(packed, image_token_id=packed.meta.vocab_size)
    samples = PackedSamples(packed)
    chosen = next(p for p in range(len(packed)) if packed[p]["num_images"].max() == 2)
    batch = collate([packed[chosen]])
    assert (batch["input_ids"] == packed.meta.vocab_size).sum() == len(batch["pixel_values"]) * packed.meta.image_positions
    loss, grads = summed_loss_and_grads(image_model, batch)
    expected, expected_grads = one_by_one(image_model, collate, samples, samples_of(samples, [chosen]))
    assert abs(loss - expected) <= EXACT * abs(expected)
    assert relative(grads, expected_grads) <= EXACT
    pixels = batch["pixel_values"]
    assert not torch.equal(pixels[0], pixels[-1])  # reversing the images changes what the model sees
    reversed_images, reversed_grads = summed_loss_and_grads(image_model, dict(batch, pixel_values=pixels.flip(0)))
    assert abs(reversed_images - expected) > 1e-4 * abs(expected) and relative(reversed_grads, expected_grads) > 1e-3


def test_a_dataloader_over_samples_with_the_sampler_gives_rows_of_whole_samples(packed):
    """PackedSamples + PackedBatchSampler + hf_collate: each row is its samples end to end, at most
    the capacity, and every sample is in one row of the epoch."""
    from torch.utils.data import DataLoader

    samples = PackedSamples(packed)
    sampler = PackedBatchSampler(samples.lengths, 4096, seed=3)
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=hf_collate(packed), num_workers=0)
    plan, seen = sampler.plan_epoch(0), []
    for step, row in enumerate(loader):
        indices = plan.batch(step, rank=0)
        expected = torch.cat([samples[j]["tokens"] for j in indices])
        assert torch.equal(row["input_ids"][0], expected) and row["input_ids"].shape[1] <= 4096
        assert row["cu_seq_lens_q"].tolist() == [0, *np.cumsum(samples.lengths[indices]).tolist()]
        seen += indices
    assert sorted(seen) == list(range(len(samples)))
