"""The recipes of docs/training_hugging_face.md, run as they are written: transformers' ``Trainer`` (on
packs, and on samples with ``PackedBatchSampler`` planning the rows) and TRL's ``SFTTrainer`` train tiny
randomly initialised LLaVA (CLIP tower, fixed 224 px crops) and Qwen2.5-VL (native resolution, mRoPE)
models on real neva_pack outputs for 3 steps on CPU (float64).

Each test takes its recipe's python block out of the page and executes it, supplying the variables the
block documents (``output_dir``, ``model``, ``tokenizer``, ``checkpoints``, ``settings``, ``capacity``):
the page cannot drift from what runs. The first step's loss must be our packed-equals-unpacked proof's
for the same row: the row's samples (two or more), each run alone through the model, their summed
next-token loss over their trained targets (for Qwen the model computing its own mRoPE ids, as its
processor's output would feed it). The steps must run (finite losses, vision tower and language model
changed). The settings each trainer needs are shown to be needed: without them the trainer itself
fails, or trains on another loss."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from neva_pack.cli import main
from neva_pack.formats import open_packed
from neva_pack.integrations import check_sft_config, check_training_arguments, sft_config, sft_data, trainer_data, training_arguments
from neva_pack.reading import PackedSamples, PackedSeqDataset
from neva_pack.text import load_tokenizer
from neva_pack.training import HF_IGNORE_INDEX, hf_collate
from tests.conftest import SAMPLE_DATA
from tests.dynamic_models import TEXT, loss_and_gradients, samples_alone
from tests.dynamic_references import hf_tokenizer, stand_in_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "training_hugging_face.md"
TOLERANCE = 1e-6
"""The trainers' losses run in float32 (ForCausalLMLoss upcasts the logits; TRL's fused head scores in
float32): the step-0 loss equals the float64 proof to float32 precision."""


def recipe(name: str) -> str:
    """The python block of the page whose first line is ``# recipe: <name>``."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)
    [block] = [block for block in blocks if block.startswith(f"# recipe: {name}\n")]
    return block


def run_recipe(name: str, **given) -> dict:
    namespace = dict(given)
    exec(compile(recipe(name), f"{PAGE.name}: {name}", "exec"), namespace)
    return namespace


def settings() -> dict:
    """The test's own TrainingArguments: what a user chooses (steps, precision, logging), on CPU."""
    return {"use_cpu": True, "max_steps": 3, "report_to": [], "save_strategy": "no", "bf16": False, "seed": 0,
            "learning_rate": 1e-3, "logging_steps": 1, "disable_tqdm": True}  # fmt: skip


def preprocess(folder: Path, records: list[dict], images: Path, *flags: str) -> Path:
    (folder / "data.json").write_text(json.dumps(records))
    output = folder / "out"
    assert main(["preprocess", "--quiet", "--data_path", str(folder / "data.json"), "--image_folder", str(images),
                 "--tokenizer_path", str(folder / "tok"), "--output_format", "compact", "--num_workers", "0",
                 "--output_dir", str(output), *flags]) == 0  # fmt: skip
    return output


@pytest.fixture(scope="module")
def llava_run(tmp_path_factory):
    """8 sample_data conversations (photos, one text-only) with the stand-in tokenizer as LLaVA's, CLIP-B/32
    224 px crops (49 features an image), 384-position packs (3, 3 and 2 samples); a tiny LlavaForConditionalGeneration."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    folder = tmp_path_factory.mktemp("llava_recipe")
    (folder / "tok").mkdir()
    stand_in_tokenizer(folder / "tok", "llama")
    records = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())[:8]
    output = preprocess(folder, records, SAMPLE_DATA / "images", "--conv_template", "v1", "--max_seq_length", "384",
                        "--hf_vision_encoder", "openai/clip-vit-base-patch32", "--tokenization", "llava")  # fmt: skip
    tokenizer = load_tokenizer(folder / "tok")
    torch.manual_seed(0)
    text = LlamaConfig(**{**TEXT, "vocab_size": tokenizer.vocab_size}, max_position_embeddings=1024, initializer_range=0.3)
    vision = CLIPVisionConfig(image_size=224, patch_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.token_to_id("<image>"),
                         vision_feature_layer=-1, vision_feature_select_strategy="default")  # fmt: skip
    config._attn_implementation = "sdpa"
    return output, LlavaForConditionalGeneration(config).double(), hf_tokenizer(folder / "tok")


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    """6 conversations (4 with an image of its own size, 2 text-only) with the stand-in tokenizer, the shipped
    Qwen2.5-VL processor at up to 16 merged patches an image, 192-position packs (3 samples each); a tiny Qwen2_5_VL model
    (2 vision blocks, one of them windowed)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = tmp_path_factory.mktemp("qwen_recipe")
    (folder / "tok").mkdir()
    stand_in_tokenizer(folder / "tok", "qwen")
    (folder / "img").mkdir()
    rng = np.random.default_rng(0)
    for k, (width, height) in enumerate([(120, 90), (60, 140), (100, 100)]):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / "img" / f"i{k}.png")
    records = [{"id": str(k), "conversations": [{"from": "human", "value": "<image>\nWhat is this?" if k % 3 else "Hello there"},
                                                {"from": "gpt", "value": "A picture of things " * (k + 1)}],
                **({"image": f"i{k % 3}.png"} if k % 3 else {})} for k in range(6)]  # fmt: skip
    output = preprocess(folder, records, folder / "img", "--conv_template", "qwen2_vl", "--max_seq_length", "192",
                        "--hf_vision_encoder", "Qwen/Qwen2.5-VL-7B-Instruct", "--max_pixels", "12544")  # fmt: skip
    tokenizer = load_tokenizer(folder / "tok")
    ids = {name: tokenizer.token_to_id(f"<|{token}|>") for name, token in
           (("image_token_id", "image_pad"), ("video_token_id", "video_pad"), ("vision_start_token_id", "vision_start"),
            ("vision_end_token_id", "vision_end"))}  # fmt: skip
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "vocab_size": tokenizer.vocab_size, "bos_token_id": None, "eos_token_id": None,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        **ids,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return output, Qwen2_5_VLForConditionalGeneration(config).double(), hf_tokenizer(folder / "tok")


def llava_proof(model, output: Path, indices: list[int]) -> tuple[float, int]:
    """The samples ``indices`` one by one (``PackedSamples``, one-sample rows), float64: their summed
    next-token loss and their trained targets (as tests/training/test_hf_batch.py proves packed == unpacked)."""
    packs = PackedSeqDataset(output)
    samples, collate = PackedSamples(packs), hf_collate(packs, image_token_id=model.config.image_token_id)
    total, targets = 0.0, 0
    with torch.no_grad():
        for j in indices:
            row = collate([samples[j]])
            inputs = {key: row[key] for key in ("input_ids", "position_ids", "pixel_values") if key in row}
            logits = model(**inputs, use_cache=False).logits[0]
            total += float(F.cross_entropy(logits, row["shift_labels"][0], ignore_index=HF_IGNORE_INDEX, reduction="sum"))
            targets += int(row["shift_labels"].ne(HF_IGNORE_INDEX).sum())
    return total, targets


def qwen_proof(model, output: Path, indices: list[int]) -> tuple[float, int]:
    """The samples ``indices`` alone as Qwen's own processor would feed them (the model computing its
    mRoPE ids), float64: their summed loss and trained targets (tests/dynamic_models.py)."""
    packs = PackedSeqDataset(output)
    reader, offsets = open_packed(output), PackedSamples(packs).offsets
    alone = []
    for j in indices:
        p = int(np.searchsorted(offsets, j, side="right")) - 1
        runs = samples_alone(reader.pack(p), packs.sample_images(p), packs.processor, "native", model.config.image_token_id)
        alone.append(runs[j - int(offsets[p])])
    total, _ = loss_and_gradients(model, alone)
    return total, sum(int(targets.ne(HF_IGNORE_INDEX).sum()) for _, targets in alone)


PROOFS = {"llava": ("llava_run", llava_proof), "qwen2_5_vl": ("qwen_run", qwen_proof)}


def samples_of_row(row: dict, output: Path, image_token_id: int) -> list[int]:
    """The samples a trainer's row holds, in order: each stretch between its ``cu_seq_lens_q`` bounds
    is the ids of exactly one sample of the output."""
    packs = PackedSeqDataset(output)
    samples, collate = PackedSamples(packs), hf_collate(packs, image_token_id=image_token_id)
    ids = [collate([samples[j]])["input_ids"][0] for j in range(len(samples))]
    bounds, found = row["cu_seq_lens_q"].tolist(), []
    for start, end in zip(bounds[:-1], bounds[1:]):
        [j] = [j for j, one in enumerate(ids) if torch.equal(one, row["input_ids"][0, start:end])]
        found.append(j)
    return found


def fast_on(family: str) -> list:
    """PROOFS' families for a recipe: ``family`` in the default run, the others with -m slow (each recipe
    runs on one family by default, and each family in some recipe)."""
    return [name if name == family else pytest.param(name, marks=pytest.mark.slow) for name in PROOFS]


def train_recipe(name: str, run, proof, tmp_path, **more) -> list[int]:
    """Run the page's recipe ``name`` for 3 steps; check the first step's loss against ``proof`` and that
    the steps trained. Returns the first row's samples."""
    output, initial, tokenizer = run
    model = copy.deepcopy(initial)  # the fixture's model stays as initialised, for the proof
    calls = []
    model.register_forward_hook(lambda module, args, kwargs, out: calls.append((kwargs, out.loss.detach())), with_kwargs=True)
    before = {key: value.detach().clone() for key, value in model.named_parameters()}
    given = {"output_dir": output, "model": model, "checkpoints": tmp_path / "checkpoints", "settings": settings(), **more}
    if name == "TRL SFTTrainer":
        given["tokenizer"] = tokenizer
    namespace = run_recipe(name, **given)
    assert namespace["trainer"].state.global_step == 3 and len(calls) == 3
    assert all(math.isfinite(float(loss)) for _, loss in calls)

    first = samples_of_row(calls[0][0], output, initial.config.image_token_id)
    assert len(first) >= 2  # samples that could see each other, were the row wrong
    total, targets = proof(initial, output, first)
    assert targets == int(calls[0][0]["shift_labels"].ne(HF_IGNORE_INDEX).sum())
    assert abs(float(calls[0][1]) - total / targets) <= TOLERANCE * total / targets

    changed = {key for key, value in model.named_parameters() if not torch.equal(value.detach(), before[key])}
    assert any("visual" in key or "vision_tower" in key for key in changed)
    assert "lm_head.weight" in changed and any("language_model" in key for key in changed)
    return first


@pytest.mark.parametrize("family", fast_on("qwen2_5_vl"))
def test_the_trainer_recipe_trains_on_packs_with_the_loss_of_the_proof(family, request, tmp_path):
    fixture, proof = PROOFS[family]
    run = request.getfixturevalue(fixture)
    first = train_recipe("transformers Trainer", run, proof, tmp_path)
    offsets = PackedSamples(PackedSeqDataset(run[0])).offsets
    assert any(first == list(range(offsets[p], offsets[p + 1])) for p in range(len(offsets) - 1))  # one whole pack


@pytest.mark.parametrize("family", fast_on("llava"))
def test_the_trl_recipe_trains_on_packs_with_the_loss_of_the_proof(family, request, tmp_path):
    fixture, proof = PROOFS[family]
    run = request.getfixturevalue(fixture)
    first = train_recipe("TRL SFTTrainer", run, proof, tmp_path)
    offsets = PackedSamples(PackedSeqDataset(run[0])).offsets
    assert any(first == list(range(offsets[p], offsets[p + 1])) for p in range(len(offsets) - 1))  # one whole pack


@pytest.mark.parametrize("family", fast_on("qwen2_5_vl"))
def test_the_multipack_recipe_trains_on_rows_the_sampler_plans(family, request, tmp_path):
    """PackedSamples + PackedBatchSampler in a Trainer: the first row is the sampler's first row of epoch 0."""
    from neva_pack.training import PackedBatchSampler

    fixture, proof = PROOFS[family]
    run = request.getfixturevalue(fixture)
    capacity = {"llava": 320, "qwen2_5_vl": 256}[family]  # two samples a row or more
    first = train_recipe("Trainer with packs planned every epoch", run, proof, tmp_path, capacity=capacity)
    samples = PackedSamples(PackedSeqDataset(run[0]))
    sampler = PackedBatchSampler.for_samples(samples, capacity=capacity, num_replicas=1, rank=None, seed=settings()["seed"])
    assert first == list(sampler.plan_epoch(0).batch(0, rank=0))


def test_a_row_needs_use_cache_false_which_the_trainer_collate_carries(qwen_run):
    """The Trainer calls ``model(**batch)``; with the config's ``use_cache=True`` Qwen2.5-VL builds no
    packed mask and a row's samples see each other. ``trainer_data``'s collate says ``use_cache=False``."""
    output, model, _ = qwen_run
    packs = PackedSeqDataset(output)
    row = trainer_data(packs, image_token_id=model.config.image_token_id)["data_collator"]([packs[0]])
    assert row["use_cache"] is False and model.config.text_config.use_cache
    total, targets = qwen_proof(model, output, samples_of_row(row, output, model.config.image_token_id))
    with torch.no_grad():
        assert abs(float(model(**row).loss) - total / targets) <= TOLERANCE * total / targets
        cached = float(model(**{**row, "use_cache": True}).loss)
    assert abs(cached - total / targets) > 1e-5 * total / targets


# --- the settings packs need: each refused in one line by ours, and shown needed by the trainer itself ---


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_the_trainer_needs_the_columns_kept(llava_run, tmp_path):
    """With remove_unused_columns=True (its default) the Trainer strips our items to the model's forward
    arguments before hf_collate reads them; ours refuse it in one line, given or in built arguments."""
    from transformers import Trainer, TrainingArguments

    output, initial, _ = llava_run
    packs = PackedSeqDataset(output)
    given = {**settings(), "output_dir": tmp_path, "max_steps": 1}
    with pytest.raises(ValueError) as refused:
        training_arguments(**given, remove_unused_columns=True)
    assert "remove_unused_columns=True" in one_line(refused) and "set remove_unused_columns=False" in one_line(refused)
    with pytest.raises(ValueError, match="remove_unused_columns=True breaks training on packs"):
        check_training_arguments(TrainingArguments(**given))
    check_training_arguments(training_arguments(**given))
    trainer = Trainer(model=copy.deepcopy(initial), args=TrainingArguments(**given), **trainer_data(packs, initial.config.image_token_id))
    with pytest.raises((KeyError, ValueError), match="cu_seqlens|image_token_id needs"):  # the columns hf_batch reads are gone
        trainer.train()


TRL_SETTINGS = {
    "remove_unused_columns": (True, ValueError, "No columns in the dataset match"),
    "dataset_kwargs": (None, KeyError, "text"),  # TRL tokenizes the index rows as text
    "packing": (True, ValueError, "custom data collator is not supported"),
    "padding_free": (True, ValueError, "custom data collator is not supported"),
}


@pytest.mark.parametrize("name", TRL_SETTINGS)
def test_trl_needs_each_setting(llava_run, tmp_path, name):
    from trl import SFTConfig, SFTTrainer

    from neva_pack.integrations.trl import REQUIRED

    value, failure, message = TRL_SETTINGS[name]
    output, initial, tokenizer = llava_run
    given = {**settings(), "output_dir": str(tmp_path), "max_steps": 1}
    with pytest.raises(ValueError) as refused:
        sft_config(**given, **{name: value})
    assert one_line(refused).startswith(f"{name}={value!r} breaks training on packs")
    args = SFTConfig(**{**given, **REQUIRED, name: value})
    with pytest.raises(ValueError, match=f"{name}={value!r} breaks training on packs"):
        check_sft_config(args)
    with pytest.raises(failure, match=message):
        SFTTrainer(model=copy.deepcopy(initial), args=args, processing_class=tokenizer,
                   **sft_data(PackedSeqDataset(output), image_token_id=initial.config.image_token_id)).train()  # fmt: skip


def test_trl_takes_the_index_dataset_not_the_torch_one(llava_run, tmp_path):
    """SFTTrainer refuses a torch dataset; sft_data's rows are item indices (no ``image`` key for TRL to
    take as vision data) that PackRows reads back, in the order the batch gives them."""
    from trl import SFTTrainer

    output, initial, tokenizer = llava_run
    packs = PackedSeqDataset(output)
    args = sft_config(**settings(), output_dir=str(tmp_path))
    check_sft_config(args)
    assert args.dataset_kwargs == {"skip_prepare_dataset": True} and not args.packing and not args.padding_free
    with pytest.raises(TypeError, match="must be a `Dataset` or `IterableDataset`, got `PackedSeqDataset`"):
        SFTTrainer(model=copy.deepcopy(initial), args=args, processing_class=tokenizer, train_dataset=packs,
                   data_collator=hf_collate(packs))  # fmt: skip
    data = sft_data(packs, image_token_id=initial.config.image_token_id)
    assert data["train_dataset"].column_names == ["index"] and data["train_dataset"]["index"] == list(range(len(packs)))
    expected = hf_collate(packs, image_token_id=initial.config.image_token_id)([packs[2], packs[0]])
    row = data["data_collator"]([{"index": 2}, {"index": 0}])
    assert row.keys() == expected.keys() and all(torch.equal(torch.as_tensor(row[k]), torch.as_tensor(expected[k])) for k in row)


def test_without_trl_the_functions_name_the_extra_in_one_line(llava_run, monkeypatch):
    """The trainers are optional: importing neva_pack.integrations needs neither, calling a TRL function
    without them says what to install."""
    import subprocess
    import sys

    loaded = "import sys, neva_pack.integrations; print(sorted({'trl', 'accelerate', 'datasets'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip() == "[]"
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    for call in (lambda: sft_config(output_dir="unused"), lambda: sft_data(PackedSeqDataset(llava_run[0]))):
        with pytest.raises(ImportError) as missing:
            call()
        assert "pip install 'neva-pack[trl]'" in one_line(missing)
