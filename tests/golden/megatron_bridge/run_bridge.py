"""Makes the megatron_bridge golden data by running Megatron Bridge's own Qwen-VL task encoder (its source at
a recorded commit, imported in a scratch directory; README beside this file).

    PYTHONPATH=<Megatron-LM>:<Bridge src>:<shim dir>:. python tests/golden/megatron_bridge/run_bridge.py <root> <case> <golden.npz>

``<root>``: a scratch directory; ``tests/llamafactory_workload.build`` writes there the records (those whose
images all open their first turn: Bridge's task encoder puts a sample's media first), the stand-in tokenizer
and our ``compact`` output of them, made with ``--image_reference megatron_bridge`` and no pixel bounds of
ours. Bridge's task encoder is built by its own ``build_energon_task_encoder`` from an ``EnergonDatasetConfig``
with ``enable_in_batch_packing=True`` and ``QwenVLEnergonTaskEncoderConfig`` at its defaults (a recipe's):
tokenizer and processor loaded as Bridge loads them, the checkpoint's settings unchanged. Its
``QwenVLTaskEncoder`` encodes
each record as an Energon ``ChatMLSample`` (its conversation JSON, its images) and batches the samples of
each of our packs (the same grouping) into one packed THD row, its ``encode_batch`` dict; our
``BridgeVLMPacks.collate_fn`` makes the row of the same pack, and of two consecutive packs. Every key must be
equal; the golden file holds Bridge's rows, per pack ``p``: ``batch{p}_<key>`` (``pixel_values`` as the
sha256 of its float32 bytes and its shape), and the fields of its ``GenericVisualInputs``.
"""

import dataclasses
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

import bridge_shim  # noqa: F401  (scratch-only: Bridge's packages without their __init__ files)
import transformers
from megatron.bridge.data.builders.energon import (
    EnergonDatasetConfig,
    QwenVLEnergonTaskEncoderConfig,
    build_energon_task_encoder,
)
from megatron.bridge.data.energon.task_encoder_utils import ChatMLSample
from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs
from PIL import Image

from neva_pack.formats import open_packed
from neva_pack.integrations.megatron_bridge import bridge_vlm_packs
from tests.llamafactory_workload import ENCODERS, QWEN2_VL_TEMPLATE, build, media_first

out = build(root, case, "compact", keep=media_first, max_pixels=None, image_reference="megatron_bridge")
shipped = json.loads((repo / "neva_pack" / "families" / "shipped" / (ENCODERS[case][0].replace("/", "__") + ".json")).read_text())
model_dir = root / "mb_model"
model_dir.mkdir(exist_ok=True)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(root / "tok" / name, model_dir / name)
shutil.copy(repo / "tests" / "golden" / "llamafactory" / f"{case}_model" / "config.json", model_dir / "config.json")
(model_dir / "preprocessor_config.json").write_text(json.dumps(shipped["preprocessor_config"]))  # the checkpoint's, as they are
template = QWEN2_VL_TEMPLATE if case == "qwen2_5_vl" else (repo / "tests" / "golden" / "qwen3_vl" / "chat_template.jinja").read_text()
(model_dir / "chat_template.jinja").write_text(template)
# Bridge's own builder, as a recipe's cfg.dataset = EnergonDatasetConfig(...) runs it
config = EnergonDatasetConfig(path=str(root), seq_length=1 << 20, micro_batch_size=1, enable_in_batch_packing=True,
                              task_encoder=QwenVLEnergonTaskEncoderConfig(hf_processor_path=str(model_dir)))  # fmt: skip
encoder = build_energon_task_encoder(config)
print(f"{config.task_encoder}; image processor {type(encoder.image_processor.image_processor).__name__}")

images = repo / "sample_data" / "images"
records = json.loads((root / "data.json").read_text())


def sample(k: int, record: dict) -> ChatMLSample:
    names = [] if "image" not in record else [record["image"]] if isinstance(record["image"], str) else list(record["image"])
    return ChatMLSample(__key__=record["id"], __restore_key__=(), __subflavors__={}, __sources__=(),
                        conversation=json.dumps(record["conversations"]),
                        imgs=[Image.open(images / name).convert("RGB") for name in names] or None)  # fmt: skip


table = open_packed(out).plan_table()
groups = [table.record_index[table.offsets[p] : table.offsets[p + 1]].tolist() for p in range(len(table.offsets) - 1)]
ours = bridge_vlm_packs(out)
assert len(ours) == len(groups) > 1


def theirs(group: list[int]) -> dict:
    encoded = [encoder.encode_sample(sample(k, records[k])) for k in group]
    return encoder.encode_batch(encoder.batch(encoded))


def same(mine: dict, own: dict, where) -> None:
    keys = {key for key, value in own.items() if value is not None and not key.startswith("__")}
    assert {key for key, value in mine.items() if value is not None} == keys, (where, sorted(keys ^ set(mine)))
    for key in keys:
        a, b = mine[key], own[key]
        if key == "visual_inputs":
            assert type(a) is type(b) and dataclasses.asdict(a).keys() == dataclasses.asdict(b).keys(), where
            for name, value in dataclasses.asdict(b).items():
                other = getattr(a, name)
                assert (value is None and other is None) or (other.dtype == value.dtype and torch.equal(other, value)), (where, name)
        elif isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (where, key)
        else:
            assert a == b, (where, key)


arrays = {"visual_fields": np.asarray([f.name for f in dataclasses.fields(GenericVisualInputs)])}
for p, group in enumerate(groups):
    own = theirs(group)
    same(ours.collate_fn([ours[p]]), own, p)
    if p + 1 < len(groups):
        same(ours.collate_fn([ours[p], ours[p + 1]]), theirs(group + groups[p + 1]), (p, p + 1))
    for key, value in own.items():
        if key.startswith("__") or value is None:
            continue
        if key == "visual_inputs":
            for name, field in dataclasses.asdict(value).items():
                if field is None:
                    continue
                if name == "pixel_values":
                    arrays[f"batch{p}_pixel_values_sha256"] = np.str_(hashlib.sha256(field.to(torch.float32).numpy().tobytes()).hexdigest())
                    arrays[f"batch{p}_pixel_values_shape"] = np.asarray(field.shape, np.int64)
                else:
                    arrays[f"batch{p}_visual_{name}"] = field.numpy()
        else:
            arrays[f"batch{p}_{key}"] = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)

# The provider, as Bridge's training setup takes it: a DatasetProvider whose build_datasets gives the
# train dataset, whose collate_fn the dataloader uses (data/utils.py, data/loaders.py).
from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider

from neva_pack.integrations.megatron_bridge import PackedVLMDatasetProvider

provider = PackedVLMDatasetProvider(path=str(out), seq_length=int(max(ours.row_lengths())))
assert isinstance(provider, DatasetProvider)
train, valid, test = provider.build_datasets(DatasetBuildContext(train_samples=len(groups), valid_samples=0, test_samples=0))
assert valid is None and test is None and hasattr(train, "collate_fn")
same(train.collate_fn([train[0]]), theirs(groups[0]), "provider")
try:
    PackedVLMDatasetProvider(path=str(out), seq_length=int(max(ours.row_lengths())) - 1).build_datasets(None)
    raise AssertionError("a row over seq_length was not refused")
except ValueError as error:
    print(f"refused: {error}")
np.savez_compressed(golden, **arrays)
print(f"Megatron Bridge QwenVLTaskEncoder, transformers {transformers.__version__}: {len(groups)} packed rows equal; wrote {golden}")
