"""Makes the automodel golden data by running NeMo Automodel itself (its PyPI wheel, unpacked on the path).

    PYTHONPATH=<unpacked nemo_automodel wheel>:. python tests/golden/automodel/run_automodel.py <root> <case> <golden.npz>

``<root>``: a scratch directory; ``tests/llamafactory_workload.build`` writes there the records, the
stand-in tokenizer and our ``compact`` output of them (the case's encoder and template). Automodel then
preprocesses the same records itself (its ``PreTokenizedDatasetWrapper``: the Qwen processor's chat
template, its processor, ``build_labels_from_template``) and packs them (its ``PackedDatasetWrapper``,
with the bins of our plan: the same samples in the same packs, in the same order, and the tiny model's
``get_rope_index`` for mRoPE, as its recipe passes it). Its ``neat_packed_vlm_collater`` collates each
of its packs, each pack of ``neva_pack.integrations.automodel.packed_dataset`` of our output, and every
pair of consecutive packs of each: every key of the items and of the batches must be equal, but for the
labels Automodel does not train (module README). The golden file holds Automodel's own items, per pack
``p``: ``item{p}_<key>`` (``pixel_values`` as the sha256 of its float32 bytes and its shape), and its
``MEDIA_KEYS``.
"""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

root, case, golden = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
repo = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(repo))

import nemo_automodel
import transformers
from nemo_automodel.components.datasets.vlm.collate_fns import neat_packed_vlm_collater
from nemo_automodel.components.datasets.vlm.datasets import PreTokenizedDatasetWrapper
from nemo_automodel.components.datasets.vlm.neat_packing_vlm import MEDIA_KEYS, PackedDatasetWrapper

from neva_pack.formats import open_packed
from neva_pack.integrations.automodel import collate, packed_dataset
from tests.llamafactory_workload import ENCODERS, QWEN2_VL_TEMPLATE, build


out = build(root, case, "compact")
shipped = json.loads((repo / "neva_pack" / "families" / "shipped" / (ENCODERS[case][0].replace("/", "__") + ".json")).read_text())
model_dir = root / "am_model"
model_dir.mkdir(exist_ok=True)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(root / "tok" / name, model_dir / name)
shutil.copy(repo / "tests" / "golden" / "llamafactory" / f"{case}_model" / "config.json", model_dir / "config.json")
(model_dir / "preprocessor_config.json").write_text(json.dumps(shipped["preprocessor_config"]))
template = QWEN2_VL_TEMPLATE if case == "qwen2_5_vl" else (repo / "tests" / "golden" / "qwen3_vl" / "chat_template.jinja").read_text()
(model_dir / "chat_template.jinja").write_text(template)
processor = transformers.AutoProcessor.from_pretrained(str(model_dir), use_fast=False)  # the PIL processor (README)
model = transformers.AutoModelForImageTextToText.from_pretrained(str(repo / "tests" / "golden" / "llamafactory" / f"{case}_model"))
model.eval()

images = repo / "sample_data" / "images"


def conversation(record: dict) -> list[dict]:
    """A LLaVA record in Automodel's conversation layout: each ``<image>`` an image item where it stands."""
    names = [] if "image" not in record else [record["image"]] if isinstance(record["image"], str) else list(record["image"])
    turns, used = [], 0
    for turn in record["conversations"]:
        role = "user" if turn["from"] == "human" else "assistant"
        content = []
        for k, text in enumerate(turn["value"].split("<image>")):
            if k:
                content.append({"type": "image", "image": str(images / names[used])})
                used += 1
            if text:
                content.append({"type": "text", "text": text})
        turns.append({"role": role, "content": content})
    assert used == len(names), record["id"]
    return turns


records = json.loads((root / "data.json").read_text())
raw = [{"conversation": conversation(r)} for r in records]
table = open_packed(out).plan_table()
bins = [table.record_index[table.offsets[p] : table.offsets[p + 1]].tolist() for p in range(len(table.offsets) - 1)]
tokenizer = processor.tokenizer
inner = PreTokenizedDatasetWrapper(raw, processor, inject_fake_images=False)
theirs = PackedDatasetWrapper(inner, bins=bins, pack_size=1 << 20, padding_idx=tokenizer.pad_token_id,
                              get_rope_index=model.model.get_rope_index)  # fmt: skip
ours = packed_dataset(out)
assert len(theirs) == len(ours) == len(bins)

im_end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.encode("\n", add_special_tokens=False)


def same_labels(mine: torch.Tensor, own: torch.Tensor, inputs: torch.Tensor) -> None:
    """Equal, but where ours trains the newline closing an answer (``<|im_end|>`` then ``\\n``), which
    Automodel's ``build_labels_from_template`` does not."""
    mine, own, inputs = mine.flatten(), own.flatten(), inputs.flatten()
    differ = mine != own
    assert bool((own[differ] == -100).all() and (inputs[differ] == im_end).all() and (mine[differ] == newline[0]).all())


def same(a, b, key, inputs=None) -> None:
    if key == "labels":
        return same_labels(a, b, inputs)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), key
    else:
        assert a == b, key


arrays = {"media_keys": np.asarray(MEDIA_KEYS)}
for p in range(len(bins)):
    mine, own = ours[p], theirs[p]
    present = {key for key, value in own.items() if value is not None}
    assert set(mine) == present, (p, sorted(set(mine) ^ present))
    for key in present:
        same(mine[key], own[key], key, own["input_ids"])
    for size in (1, 2):
        if p + size > len(bins):
            continue
        a = collate([ours[q] for q in range(p, p + size)], processor=processor)
        b = neat_packed_vlm_collater([theirs[q] for q in range(p, p + size)], padding_idx=tokenizer.pad_token_id)
        assert set(a) == set(b), (p, size)
        for key in b:
            same(a[key], b[key], key, b["input_ids"])
    for key in sorted(present):
        value = own[key]
        if key == "pixel_values":
            arrays[f"item{p}_pixel_values_sha256"] = np.str_(hashlib.sha256(value.to(torch.float32).numpy().tobytes()).hexdigest())
            arrays[f"item{p}_pixel_values_shape"] = np.asarray(value.shape, np.int64)
        else:
            arrays[f"item{p}_{key}"] = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)

# The YAML of docs/training_automodel.md, as Automodel's recipe resolves and builds it, gives batches of
# its collater over its own packs (the sampler's order, two packs a step).
import re

from nemo_automodel.components.config.loader import load_yaml_config
from nemo_automodel.recipes._typed_config import RecipeConfig

page = (repo / "docs" / "training_automodel.md").read_text()
[block] = [b for b in re.findall(r"```yaml\n(.*?)```", page, flags=re.DOTALL) if "neva_pack.integrations.automodel" in b]
(root / "recipe.yaml").write_text(block.replace("path: out/", f"path: {out}/"))
cfg = load_yaml_config(root / "recipe.yaml")
config = RecipeConfig.resolve_vlm_dataloader(cfg.dataset, cfg.dataloader)
assert config.pretokenization is None and config.packing is None and config.collator is not None
loader = config.build(pretrained_model_name_or_path=str(model_dir), dp_rank=0, dp_world_size=1, batch_size=2).dataloader
order = list(iter(loader.sampler))
steps = 0
for step, batch in enumerate(loader):
    b = neat_packed_vlm_collater([theirs[q] for q in order[2 * step : 2 * step + 2]], padding_idx=tokenizer.pad_token_id)
    assert set(batch) == set(b), step
    for key in b:
        same(batch[key], b[key], key, b["input_ids"])
    steps += 1
assert steps == (len(bins) + 1) // 2
print(f"the YAML of docs/training_automodel.md: {steps} batches of its collater over its own packs")

# its default (torchvision) image processor, against the PIL one our pixel values are equal to
fast = transformers.AutoProcessor.from_pretrained(str(model_dir))
fast_packs = PackedDatasetWrapper(PreTokenizedDatasetWrapper(raw, fast, inject_fake_images=False), bins=bins, pack_size=1 << 20,
                                  padding_idx=tokenizer.pad_token_id, get_rope_index=model.model.get_rope_index)  # fmt: skip
largest = max(float((fast_packs[p]["pixel_values"].float() - theirs[p]["pixel_values"].float()).abs().max()) for p in range(len(bins)))
print(f"its torchvision image processor: pixel values up to {largest:.4f} from the PIL processor's (and ours)")
np.savez_compressed(golden, **arrays)
print(f"nemo_automodel {nemo_automodel.__version__}, transformers {transformers.__version__}: {len(bins)} packs equal; wrote {golden}")
