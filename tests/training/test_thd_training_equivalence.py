"""Proof that a packed THD batch trains exactly like its samples run one by one.

A tiny causal LM (plain torch, CPU, float64) with a stand-in vision projector that writes each
image's embedding over its placeholder run reads (a) ``thd_batch`` of every pack of a real
pipeline output, with block-diagonal causal attention from the cu_seqlens and position ids that
restart per sample, and (b) each sample as the SampleBuilder made it, alone. Per-sample losses
and every parameter gradient must agree to 1e-9 — with and without alignment padding (M = 8),
fixed-length batches included, for every --output_format the CLI offers, with multi-image and
text-only samples sharing packs. A collate that gets any of it wrong (images out of order,
positions not reset, a label crossing into the next sample) must fail the same comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neva_pack.cli import build_parser, config_from_args, main
from neva_pack.reading import PackedSeqDataset
from neva_pack.formats import FORMATS
from neva_pack.pipeline import build_sample_builder
from neva_pack.records import iter_raw_records
from neva_pack.training import thd_batch
from neva_pack.files import packed_prefix
from tests.conftest import SAMPLE_DATA

TOLERANCE = 1e-9
WRONG = 1e-6
"""A wrong collate must move some loss or gradient by more than this."""


def output_formats() -> list[str]:
    """Every registered output format that holds images (the sample data has them): a new format is
    tested without edits. A text-only one reads back as these do (test_formats converts between them)."""
    return sorted(name for name, fmt in FORMATS.items() if fmt.holds_images)


def preprocess_args(output_dir, output_format, multiple):
    args = [
        "preprocess", "--quiet", "--data_path", str(SAMPLE_DATA / "llava_sample.json"),
        "--image_folder", str(SAMPLE_DATA / "images"), "--tokenizer_path", str(SAMPLE_DATA / "tokenizer.model"),
        "--output_dir", str(output_dir), "--conv_template", "v1", "--num_workers", "0",
        "--hf_vision_encoder", "openai/clip-vit-base-patch32",  # 49 positions per image: small and fast
        "--max_seq_length", "512", "--seed", "3", "--pad_to_multiple_of", str(multiple),
    ]  # fmt: skip
    return args + ["--output_format", output_format]


class TinyVLM(torch.nn.Module):
    """Embeddings + learned positions, 2 pre-norm attention/MLP blocks, a linear vision projector.

    Attention is causal inside each segment of ``bounds`` (cumulative positions) and blocked
    across segments: what THD attention computes from cu_seqlens.
    """

    def __init__(self, vocab: int, image_positions: int, start_id: int, max_positions: int, dim: int = 16, heads: int = 2):
        super().__init__()
        self.image_positions, self.start_id, self.heads = image_positions, start_id, heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Embedding(max_positions, dim)
        self.projector = torch.nn.Linear(3 * 7 * 7, image_positions * dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "norm1": torch.nn.LayerNorm(dim),
                    "qkv": torch.nn.Linear(dim, 3 * dim),
                    "out": torch.nn.Linear(dim, dim),
                    "norm2": torch.nn.LayerNorm(dim),
                    "mlp": torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)),
                }
            )
            for _ in range(2)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, position_ids, images, bounds):
        x = self.embed(tokens)
        starts = torch.nonzero(tokens == self.start_id).flatten()
        if len(starts) != len(images):
            raise ValueError(f"{len(starts)} image runs, {len(images)} images")
        if len(images):  # the stand-in encoder + projector, written over the k-th run
            pooled = F.adaptive_avg_pool2d(images, 7).flatten(1)
            embeddings = self.projector(pooled).view(-1, x.shape[-1])
            where = (starts[:, None] + torch.arange(self.image_positions)).flatten()
            x = x.index_put((where,), embeddings)
        x = x + self.position(position_ids)
        segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.diff(bounds.long()))
        mask = (segment[:, None] == segment[None, :]) & torch.ones(len(x), len(x), dtype=torch.bool).tril()
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).view(len(x), 3, self.heads, -1).permute(1, 2, 0, 3)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + block["out"](attended.transpose(0, 1).reshape(len(x), -1))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(self.norm(x))


def per_token_loss(logits, labels, ignore_index=-1):
    """The NaN-safe recipe of neva_pack.training.thd: select, never multiply by the mask."""
    return torch.where(labels != ignore_index, F.cross_entropy(logits, labels.clamp(min=0), reduction="none"), 0.0)


def packed_losses(model, batch, spoil_padding: bool = False) -> torch.Tensor:
    """Per-sample mean losses from one THD batch, with the batch's own normalisation metadata
    (``spoil_padding``: NaN logits on every padding position, as a kernel that skips padding may leave)."""
    tokens, labels = batch["tokens"][0], batch["labels"][0]
    logits = model(tokens, batch["position_ids"][0], batch["images"].double(), batch["cu_seqlens_q"])
    if spoil_padding:
        logits = torch.where(batch["padding_mask"][0, :, None], torch.nan, logits)
    loss = torch.where(batch["loss_mask"][0] > 0, per_token_loss(logits, labels), 0.0)
    segment = batch["segment_ids"][0]
    sums = torch.zeros(batch["num_samples"], dtype=torch.float64).index_add(0, segment.clamp(min=0), loss * (segment >= 0))
    return sums / batch["num_targets"].clamp(min=1)


def gradients(model, total: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    total.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def unpacked(model, samples) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each sample alone (one segment, positions 0..L-1); the per-sample losses and the gradient of their sum."""
    model.zero_grad()
    losses = []
    for sample in samples:
        tokens, labels = torch.from_numpy(sample["tokens"]).long(), torch.from_numpy(sample["labels"]).long()
        logits = model(tokens, torch.arange(len(tokens)), sample["images"], torch.tensor([0, len(tokens)]))
        loss = per_token_loss(logits, labels).sum() / max(1, int((labels != -1).sum()))
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def max_differences(model, batch, reference) -> tuple[float, float]:
    """(max |loss difference| over samples, max |gradient difference| over every parameter)."""
    losses = packed_losses(model, batch)
    packed_grads = gradients(model, losses.sum())
    reference_losses, reference_grads = reference
    loss_diff = float((losses.detach() - reference_losses).abs().max())
    grad_diff = max(float((packed_grads[name] - reference_grads[name]).abs().max()) for name in packed_grads)
    return loss_diff, grad_diff


FAST_FORMAT = "nemo"
"""The format every check runs on by default; the others' runs are slow (-m slow): their readers give
the nemo reader's tensors bit for bit (formats/test_output_formats.py, formats/test_formats.py)."""


@pytest.fixture(
    scope="module",
    params=[pytest.param((f, m), marks=() if f == FAST_FORMAT else pytest.mark.slow) for f in output_formats() for m in (1, 8)],
    ids=lambda p: f"{p[0]}-M{p[1]}",
)
def case(request, tmp_path_factory):
    """A real pipeline output, its THD batch of all packs, and every sample as the builder made it."""
    output_format, multiple = request.param
    out = tmp_path_factory.mktemp("equivalence") / "out"
    args = preprocess_args(out, output_format, multiple)
    assert main(args) == 0
    config = config_from_args(build_parser().parse_args(args))
    builder = build_sample_builder(config)
    reference = {}
    for raw in iter_raw_records(config.data_path):
        sample = builder.build(raw)
        images = torch.from_numpy(builder.preprocessor.normalize(sample.images)).double()
        reference[tuple(sample.tokens.tolist())] = {"tokens": sample.tokens, "labels": sample.labels, "images": images}
    assert len(reference) == 20  # every sample is told apart by its tokens
    dataset = PackedSeqDataset(packed_prefix(out))
    packs = [dataset[p] for p in range(len(dataset))]
    samples = []
    for item in packs:  # the reference samples in pack order, found by their real tokens
        starts, real = item["cu_seqlens"][:-1], torch.diff(item["cu_seqlens_unpadded"])
        samples += [reference[tuple(item["tokens"][s : s + n].tolist())] for s, n in zip(starts.tolist(), real.tolist())]
    mixed = [item for item in packs if (item["num_images"] >= 2).any() and (item["num_images"] == 0).any()]
    assert mixed, "the fixture must hold a pack with a multi-image sample beside a text-only one"
    ids = dataset.meta.image_token_ids
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TinyVLM(dataset.meta.vocab_size, dataset.meta.image_positions, ids.start, 8192).double()
    reference = unpacked(model, samples)  # computed once: the model is never updated
    return {"packs": packs, "samples": samples, "model": model, "multiple": multiple, "reference": reference}


@pytest.mark.parametrize("fixed_length", [False, True])
def test_packed_thd_batch_trains_exactly_like_the_samples_one_by_one(case, fixed_length):
    batch = thd_batch(case["packs"], fixed_length, max_seq_length=512, max_samples_per_pack=20,
                      pad_to_multiple_of=case["multiple"], with_packed_seq_params=False)
    if case["multiple"] > 1:  # attention runs over the padded segments; the real ones are kept beside them
        assert not torch.equal(batch["cu_seqlens_q"], batch["cu_seqlens_unpadded"]) and batch["padding_mask"].any()
    loss_diff, grad_diff = max_differences(case["model"], batch, case["reference"])
    print(f"max |loss diff| {loss_diff:.3e}, max |grad diff| {grad_diff:.3e}")
    assert loss_diff <= TOLERANCE and grad_diff <= TOLERANCE


def test_the_per_sample_loss_weight_gives_the_mean_of_the_sample_means(case):
    batch = thd_batch(case["packs"], with_packed_seq_params=False)
    model = case["model"]
    with torch.no_grad():
        logits = model(batch["tokens"][0], batch["position_ids"][0], batch["images"].double(), batch["cu_seqlens_q"])
        ce = per_token_loss(logits, batch["labels"][0])
        weighted = (ce * batch["sample_loss_weight"][0].double()).sum() / batch["num_samples"]
        per_token = ce.sum() / batch["num_target_tokens"]
    losses = packed_losses(model, batch).detach()
    assert torch.allclose(weighted, losses.mean(), rtol=1e-6)  # float32 weights
    assert batch["num_target_tokens"] == sum(int((torch.from_numpy(s["labels"]) != -1).sum()) for s in case["samples"])
    assert per_token > 0


def test_nan_logits_on_padding_leave_the_losses_unchanged(case):
    """The loss recipe selects supervised positions: whatever padding holds never reaches the total."""
    batch = thd_batch(case["packs"], with_packed_seq_params=False)
    with torch.no_grad():
        losses = packed_losses(case["model"], batch, spoil_padding=True)
    assert batch["padding_mask"].any() == (case["multiple"] > 1)
    assert float((losses - case["reference"][0]).abs().max()) <= TOLERANCE


def _images_reversed(batch):
    return {**batch, "images": batch["images"].flip(0)}


def _positions_not_reset(batch):
    return {**batch, "position_ids": torch.arange(batch["tokens"].shape[1])[None]}


def _label_crosses_a_boundary(batch):
    """The last real position of the first sample is trained to predict the next sample's first token."""
    labels, mask = batch["labels"].clone(), batch["loss_mask"].clone()
    bounds = batch["cu_seqlens_q"]
    last = int(batch["cu_seqlens_unpadded"][1]) - 1
    labels[0, last] = batch["tokens"][0, int(bounds[1])]
    mask[0, last] = 1.0
    return {**batch, "labels": labels, "loss_mask": mask}


@pytest.mark.parametrize("wrong", [_images_reversed, _positions_not_reset, _label_crosses_a_boundary])
def test_a_wrong_collate_fails_the_comparison(case, wrong):
    batch = wrong(thd_batch(case["packs"], with_packed_seq_params=False))
    loss_diff, grad_diff = max_differences(case["model"], batch, case["reference"])
    print(f"{wrong.__name__}: max |loss diff| {loss_diff:.3e}, max |grad diff| {grad_diff:.3e}")
    assert max(loss_diff, grad_diff) > WRONG
