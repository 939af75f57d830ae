"""Tiny real models and the loss/gradient comparison of the dynamic-resolution training proofs:
randomly initialised ``Qwen2VLForConditionalGeneration`` and ``LlavaOnevisionForConditionalGeneration``
(float64, CPU), the summed loss and every
gradient of packed ``hf_batch`` rows against the samples run one by one as the model's own
processor would feed them, and the relative difference of the two."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from neva_pack.reading import dynamic_pack_item, sample_of_pack
from neva_pack.families import resolve_encoder
from neva_pack.training import HF_IGNORE_INDEX, hf_batch
from tests.dynamic_packs import IMAGE, VIDEO, VISION_END, VISION_START, VOCAB

TOLERANCE = 1e-9
TEXT = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip


def qwen_model(vocab_size: int = VOCAB, image: int = IMAGE, video: int = VIDEO, vision_start: int = VISION_START,
               vision_end: int = VISION_END):  # fmt: skip
    """A tiny randomly initialised Qwen2VLForConditionalGeneration (float64, seeded) over ``vocab_size``
    ids with these special token ids."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config={**TEXT, "vocab_size": vocab_size, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 2, "embed_dim": 16, "hidden_size": 16, "num_heads": 2, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},  # fmt: skip
        image_token_id=image, video_token_id=video, vision_start_token_id=vision_start, vision_end_token_id=vision_end,
    )
    config._attn_implementation = "sdpa"
    return Qwen2VLForConditionalGeneration(config).double()


def onevision_model(directory, vocab_size: int = VOCAB, image: int = IMAGE):
    """A tiny randomly initialised LlavaOnevisionForConditionalGeneration (float64, seeded; SigLIP tower
    of 384 px tiles and 48 px patches: 8 x 8 features a tile, "full" selection, ``anyres_max_9``) with
    the shipped llava-onevision-qwen2-7b-ov settings (pinpoints, mean, std), saved to ``directory`` as a
    checkpoint whose ``--hf_vision_encoder`` counts its tokens."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    shipped = resolve_encoder("llava-hf/llava-onevision-qwen2-7b-ov-hf")
    torch.manual_seed(0)
    config = LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **TEXT, "vocab_size": vocab_size},
        vision_config={"model_type": "siglip_vision_model", "image_size": 384, "patch_size": 48, "hidden_size": 16,
                       "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2},  # fmt: skip
        image_token_index=image, video_token_index=vocab_size - 1, vision_feature_layer=-1,
        vision_feature_select_strategy=shipped.model_config["vision_feature_select_strategy"],
        vision_aspect_ratio=shipped.model_config["vision_aspect_ratio"],
        image_grid_pinpoints=shipped.preprocessor_config["image_grid_pinpoints"],
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    config.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(shipped.preprocessor_config))
    return LlavaOnevisionForConditionalGeneration(config).double()


def summed_loss(model, batch: dict, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of a batch row's trained targets (the model's inputs taken from ``batch``)."""
    inputs = {key: value for key, value in batch.items() if key in ("input_ids", "position_ids", "pixel_values", "image_grid_thw",
                                                                    "image_sizes", "mm_token_type_ids",
                                                                    "batch_num_images")}  # fmt: skip
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].double()
    logits = model(**inputs, use_cache=False).logits[0]
    return F.cross_entropy(logits, targets.clamp(min=0), reduction="none").where(targets != HF_IGNORE_INDEX, 0).sum()


def loss_and_gradients(model, batches: list[tuple[dict, torch.Tensor]]) -> tuple[float, dict]:
    """The summed loss over ``batches`` and every parameter's gradient of it."""
    model.zero_grad()
    total = sum(summed_loss(model, batch, targets) for batch, targets in batches)
    total.backward()
    total = total.detach()
    return float(total), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def packed(model, items: list[dict], image: int = IMAGE) -> tuple[float, dict]:
    """Loss and gradients of the packs ``items`` as one ``hf_batch`` row (``image``: the patch id)."""
    batch = hf_batch(items, image, image_patch_id=image)
    return loss_and_gradients(model, [(batch, batch["shift_labels"][0])])


def one_by_one(model, pack, counts, processor, family, image: int = IMAGE) -> tuple[float, dict]:
    """Each sample alone, unpadded, as the model's own processor output would feed it."""
    return loss_and_gradients(model, samples_alone(pack, counts, processor, family, image))


def samples_alone(pack, counts, processor, family, image: int = IMAGE) -> list[tuple[dict, torch.Tensor]]:
    """(model inputs, targets) of each sample of a read pack alone (``family``: "native" or "anyres")."""
    runs = []
    for k in range(len(counts)):
        item = dynamic_pack_item(sample_of_pack(pack, counts, k), counts[k : k + 1], processor, image)
        length = int(item["cu_seqlens_unpadded"][-1])
        ids = item["tokens"][:length][None]
        batch = {"input_ids": ids}
        if int(item["num_images"].sum()):
            batch["pixel_values"] = item["pixel_values"]
            batch.update({key: item[key] for key in ("image_grid_thw", "image_sizes") if key in item})
            if "batch_num_images" in item:  # OneVision's processor: a sample alone is a batch of one, of its images
                batch["batch_num_images"] = torch.tensor([len(item["pixel_values"])])
        if family == "native":
            batch["mm_token_type_ids"] = (ids == image).int()  # the processor's: the model computes its own mRoPE ids
        targets = item["labels"][:length]
        runs.append((batch, torch.where(targets < 0, HF_IGNORE_INDEX, targets)))
    return runs


def difference(a: tuple[float, dict], b: tuple[float, dict]) -> float:
    """Largest relative difference of the loss and of any gradient (relative to the gradient's norm;
    a gradient that is zero in exact arithmetic, as the vision tower's key biases', is rounding noise
    of ~1e-19 on both sides: its norm counts as at least 1e-6)."""
    worst = abs(a[0] - b[0]) / abs(b[0])
    assert a[1].keys() == b[1].keys()
    for name in b[1]:
        worst = max(worst, float((a[1][name] - b[1][name]).norm() / b[1][name].norm().clamp(min=1e-6)))
    return worst
