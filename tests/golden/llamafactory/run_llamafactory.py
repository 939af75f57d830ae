"""Makes the llamafactory golden data by running LLaMA-Factory itself (a scratch venv, never this project's).

    python run_llamafactory.py <root> <case> <golden.npz>

``<root>`` is what ``tests/llamafactory_workload.py build`` wrote (tokenizer, records, our output).
LLaMA-Factory preprocesses and packs the same records itself (``get_dataset``, sft, ``packing`` +
``neat_packing``, its ``greedy_knapsack`` given our plan's grouping: the same samples in the same
packs, in the same order), then its own collator (``SFTDataCollatorWith4DAttentionMask``, as its sft
workflow builds it, with a tiny random model of the case's architecture for ``get_rope_index``)
collates each row of its own dataset and each row of ours (``load_from_disk`` of our directory, as
``tokenized_path`` loads it). Every column of the rows and every tensor of the batches must be equal;
the golden file holds LLaMA-Factory's own, per pack ``p``: ``row{p}_<column>``, ``batch{p}_<key>`` and
``batch{p}_loss``, the tiny model's loss on its batch (the model saved beside it, ``<case>_model/``)
(``pixel_values`` as the sha256 of its float32 bytes and its shape; the 4-D attention mask left out).
"""

import collections
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

root, case, golden = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
FAST = len(sys.argv) > 4 and sys.argv[4] == "fast"
"""LLaMA-Factory's ``use_fast_tokenizer`` (also its image processor's ``use_fast``): the golden data is made
with false (the PIL processor, which neva_pack's stored images are bit-identical to); ``fast`` reports
how far the torchvision processor's pixel values are from ours."""
ROWS = ("input_ids", "attention_mask", "position_ids", "labels")
BATCH = ("input_ids", "labels", "attention_mask", "position_ids", "pixel_values", "image_grid_thw")
CASES = {"qwen2_5_vl": ("qwen2_vl", "Qwen__Qwen2.5-VL-7B-Instruct.json"), "qwen3_vl": ("qwen3_vl_nothink", "Qwen__Qwen3-VL-2B-Instruct.json"),
         "llava": ("llava", "openai__clip-vit-large-patch14-336.json")}
"""Our case -> LLaMA-Factory's template (``qwen3_vl_nothink``: its plain Qwen3-VL ChatML; its ``qwen3_vl`` is a
reasoning template adding empty think blocks; ``llava``: its Vicuna template with its LlavaPlugin) and the
shipped processor settings."""
template_name, shipped = CASES[case]

import llamafactory
from datasets import load_from_disk
from llamafactory.data import (
    SFTDataCollatorWith4DAttentionMask,
    get_dataset,
    get_template_and_fix_tokenizer,
)
from llamafactory.data.processor import supervised
from llamafactory.hparams import get_train_args
from llamafactory.model import load_tokenizer

repo = Path(__file__).resolve().parents[3]
model_dir = root / "lf_model"
model_dir.mkdir(exist_ok=True)
for name in ("tokenizer.json", "tokenizer_config.json"):
    (model_dir / name).write_bytes((root / "tok" / name).read_bytes())
encoder = json.loads((repo / "neva_pack" / "families" / "shipped" / shipped).read_text())
(model_dir / "preprocessor_config.json").write_text(json.dumps(encoder["preprocessor_config"]))

import transformers

torch.manual_seed(0)
text = {"vocab_size": 1500, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1}
ids = {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}
if case == "llava":  # LLaVA-1.5 as llava-hf ships it: CLIP-L/14-336 tower, its processor's patch size and feature strategy
    (model_dir / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor", "patch_size": 14,
                                                                "vision_feature_select_strategy": "default",
                                                                "num_additional_image_tokens": 1, "image_token": "<image>"}))
    vocab = json.loads((root / "tok" / "tokenizer.json").read_text())
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(image_size=336, patch_size=14, hidden_size=16, intermediate_size=32,
                                                    num_hidden_layers=1, num_attention_heads=2),
        text_config=transformers.LlamaConfig(**{**text, "vocab_size": 1000}, max_position_embeddings=4096),  # 991 ids, rounded up
        image_token_id=max(token["id"] for token in vocab["added_tokens"] if token["content"] == "<image>"),
        vision_feature_layer=-1, vision_feature_select_strategy="default")
    model = transformers.LlavaForConditionalGeneration(config)
elif case == "qwen2_5_vl":
    config = transformers.Qwen2_5_VLConfig(
        text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "out_hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                       "fullatt_block_indexes": [0]}, **ids)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
else:
    config = transformers.Qwen3VLConfig(
        text_config={**text, "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [1, 1, 2],
                                                                "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "out_hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                       "deepstack_visual_indexes": [0], "num_position_embeddings": 64}, **ids)
    model = transformers.Qwen3VLForConditionalGeneration(config)
model.eval()
model.save_pretrained(model_dir)
model.save_pretrained(golden.with_name(f"{case}_model"))  # its weights: our suite runs the same model on our batches

out = root / "out"
index = np.load(out / "packed_seq_dataset.llamafactory.index.npz")
ours_meta = json.loads((out / "packed_seq_dataset.meta.json").read_text())
cutoff_len = ours_meta["layout"]["cutoff_len"]
groups = [index["record_index"][index["offsets"][p] : index["offsets"][p + 1]].tolist() for p in range(len(index["offsets"]) - 1)]


planned: dict[int, list[int]] = {}
"""Per sample length, the records of that length in the order our plan packs them."""


def our_grouping(lengths, capacity):
    """LLaMA-Factory's packer replaced by our plan: its lengths are in record order (none dropped)."""
    assert capacity == cutoff_len - 1 and len(lengths) == sum(map(len, groups)), (capacity, cutoff_len, len(lengths), groups, lengths)
    planned.clear()
    for group in groups:
        for r in group:
            planned.setdefault(lengths[r], []).append(r)
    return [[lengths[r] for r in group] for group in groups]


class PlannedIndexes(list):
    """The records of one length in LLaMA-Factory's ``length2indexes``: it takes them back with ``pop()``, the
    last first; with two records of one length, this gives the one our plan packs next (the same records
    in the same packs; only which of two equal lengths is which)."""

    def __init__(self, length):
        super().__init__()
        self.length = length

    def pop(self, *where):
        assert not where, where
        record = planned[self.length].pop(0)
        self.remove(record)
        return record


class LengthIndexes(collections.defaultdict):
    """``defaultdict`` in LLaMA-Factory's packing processor: its ``length2indexes`` (int keys) gets PlannedIndexes."""

    def __missing__(self, key):
        self[key] = PlannedIndexes(key) if isinstance(key, int) else self.default_factory()
        return self[key]


supervised.greedy_knapsack = our_grouping
supervised.defaultdict = LengthIndexes
(root / "dataset_info.json").write_text(json.dumps({"golden": {"file_name": "lf_data.json", "formatting": "sharegpt",
                                                               "columns": {"messages": "conversations", "images": "images"}}}))
work = Path(tempfile.mkdtemp())
model_args, data_args, training_args, finetuning_args, _ = get_train_args({
    "model_name_or_path": str(model_dir), "stage": "sft", "do_train": True, "finetuning_type": "full", "template": template_name,
    "dataset": "golden", "dataset_dir": str(root), "media_dir": str(repo / "sample_data" / "images"), "cutoff_len": cutoff_len,
    "packing": True, "neat_packing": True, "output_dir": str(work / "o"), "overwrite_cache": True, "report_to": "none",
    "preprocessing_num_workers": None, "use_fast_tokenizer": FAST,
})
tokenizer_module = load_tokenizer(model_args)
tokenizer = tokenizer_module["tokenizer"]
template = get_template_and_fix_tokenizer(tokenizer, data_args)
theirs = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)["train_dataset"]
ours = load_from_disk(str(out / "packed_seq_dataset.llamafactory"))
assert len(theirs) == len(ours) == len(groups), (len(theirs), len(ours), len(groups))

collator = SFTDataCollatorWith4DAttentionMask(template=template, model=model, pad_to_multiple_of=8, label_pad_token_id=-100,
                                              block_diag_attn=model_args.block_diag_attn, neat_packing=True,
                                              attn_implementation="sdpa", compute_dtype=torch.float32, **tokenizer_module)
arrays = {}
for p in range(len(groups)):
    mine, own = ours[p], theirs[p]
    for column in (*ROWS, "packing_params"):
        assert mine[column] == own[column], (p, column)
    assert len(mine["images"] or []) == len(own["images"] or []), p
    a, b = collator([dict(mine)]), collator([dict(own)])
    for key in BATCH:
        if key not in b:
            continue
        if FAST and key == "pixel_values":
            print(f"pack {p}: fast processor, largest pixel_values difference {(a[key] - b[key]).abs().max().item():.4f}")
            continue
        assert torch.equal(a[key], b[key]), (p, key)
        if key == "pixel_values":  # 1,176 floats a patch: its digest, of the float32 bytes, and its shape
            arrays[f"batch{p}_pixel_values_sha256"] = np.str_(hashlib.sha256(b[key].numpy().tobytes()).hexdigest())
            arrays[f"batch{p}_pixel_values_shape"] = np.asarray(b[key].shape, np.int64)
        elif key != "attention_mask":  # the 4-D mask (L x L floats) is the row's segment ids, checked above
            arrays[f"batch{p}_{key}"] = b[key].numpy()
    with torch.no_grad():  # the tiny model's loss on its own batch (its sft loss: mean over the trained labels)
        loss = model(**{key: b[key] for key in (*BATCH, "labels") if key in b}).loss
    arrays[f"batch{p}_loss"] = np.float64(loss.item())
    for column in ROWS:
        arrays[f"row{p}_{column}"] = np.asarray(own[column], np.int64)
    params = own["packing_params"]
    arrays[f"row{p}_sequence_boundaries"] = np.asarray(params["sequence_boundaries"], np.int64)
    arrays[f"row{p}_image_subseq_ids"] = np.asarray(params["image_subseq_ids"], np.int64)
    arrays[f"row{p}_right_padding_length"] = np.int64(params["right_padding_length"])
arrays["cutoff_len"] = np.int64(cutoff_len)
np.savez_compressed(golden, **arrays)
print(f"llamafactory {llamafactory.__version__}: {len(groups)} packs equal; wrote {golden}")
