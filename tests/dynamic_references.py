"""Reference processors for the dynamic-resolution families, as transformers builds them, over the
stand-in tokenizer (tests/golden/dynamic/tokenizer.json: a small byte-level BPE carrying the models'
real special tokens), and the prompts the reference templates make: what samples and end-to-end
runs are compared with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from neva_pack.families import resolve_encoder

STAND_IN_TOKENIZER = Path(__file__).parent / "golden" / "dynamic" / "tokenizer.json"
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
TOKENIZER_CONFIGS = {"qwen": {"eos_token": "<|im_end|>"}, "llama": {"bos_token": "<s>", "eos_token": "</s>"}}
"""The stand-in tokenizer's BOS/EOS as a Qwen2 model (no BOS, <|im_end|>) and a LLaMA one have them."""


def stand_in_tokenizer(folder: Path, kind: str) -> Path:
    """A tokenizer directory in ``folder``: the stand-in tokenizer with ``kind``'s BOS/EOS."""
    shutil.copy(STAND_IN_TOKENIZER, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIGS[kind]))
    return folder


def image_processor_settings(encoder_name: str) -> dict:
    """The shipped preprocessor_config.json as keyword arguments of transformers' image processor."""
    return {k: v for k, v in resolve_encoder(encoder_name).preprocessor_config.items()
            if k not in ("image_processor_type", "processor_class", "aspect_ratio_setting")}  # fmt: skip


def hf_tokenizer(tokenizer_dir):
    """transformers' fast tokenizer of a ``stand_in_tokenizer`` directory."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), **config)


def qwen_reference(tokenizer_dir, encoder_name):
    """Qwen2VLProcessor with Qwen2VLImageProcessorPil of the checkpoint's settings. Its constructor
    insists on a video processor, which needs torchvision (not installed): the instance gets what its
    __init__ sets, and its own __call__ does the work."""
    from transformers.models.qwen2_vl import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = image_processor_settings(encoder_name)
    tokenizer = hf_tokenizer(tokenizer_dir)
    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.__dict__.update(
        image_processor=Qwen2VLImageProcessorPil(**settings), tokenizer=tokenizer, video_processor=None, chat_template=None,
        image_token="<|image_pad|>", video_token="<|video_pad|>", image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
    )  # fmt: skip
    return processor


def anyres_reference(tokenizer_dir, encoder_name):
    """LlavaNextProcessor or LlavaOnevisionProcessor (built as ``qwen_reference`` is: its video processor
    needs torchvision) with the PIL image processor of the checkpoint's settings."""
    from transformers import LlavaNextProcessor, LlavaOnevisionProcessor
    from transformers.models.llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

    encoder = resolve_encoder(encoder_name)
    model = encoder.model_config
    settings = image_processor_settings(encoder_name)
    tokenizer = hf_tokenizer(tokenizer_dir)
    if encoder.processor == "llava_onevision":
        processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
        processor.__dict__.update(
            image_processor=LlavaOnevisionImageProcessorPil(**settings), tokenizer=tokenizer, video_processor=None,
            chat_template=None, num_image_tokens=model["num_image_tokens"],
            vision_feature_select_strategy=model["vision_feature_select_strategy"],
            vision_aspect_ratio=model["vision_aspect_ratio"], image_token="<image>", video_token="<video>",
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), video_token_id=None,
        )  # fmt: skip
        return processor
    return LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(**settings), tokenizer=tokenizer, patch_size=encoder.patch_size,
        vision_feature_select_strategy=model["vision_feature_select_strategy"],
        num_additional_image_tokens=model["num_additional_image_tokens"], image_token="<image>",
    )  # fmt: skip


def reference_ids(processor, prompt: str, names, folder) -> np.ndarray:
    """The processor's ids of one sample's prompt, its images (``names`` in ``folder``) together."""
    pictures = [Image.open(folder / name).convert("RGB") for name in names]
    out = processor(text=[prompt], images=[pictures] if pictures else None)  # one sample: its images together
    return np.asarray(out["input_ids"][0], dtype=np.int64)


VICUNA = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the user's questions."
)


def llava_prompt(template: str, tokenization: str, turns) -> str:
    """The reference template's prompt of ``turns`` ((text, image names) of the human, then the gpt's text,
    alternating): LLaVA v1.6 ``vicuna_v1`` (NeMo's or LLaVA's spacing), ``mistral_instruct``, OneVision's ChatML."""
    text = []
    for k, turn in enumerate(turns):
        if template == "vicuna_v1":
            sep = " " if (k and tokenization == "nemo" and not k % 2) else ""
            text.append(f"ASSISTANT: {turn}</s>" if k % 2 else sep + "USER: " + "<image>\n" * len(turn[1]) + turn[0] + " ")
        elif template == "mistral_instruct":
            text.append(f" {turn} </s>" if k % 2 else "[INST] " + "<image>\n" * len(turn[1]) + turn[0] + " [/INST]")
        else:
            user = "<|im_start|>user\n" + "<image>\n" * (len(turn[1]) if not k % 2 else 0) + (turn[0] if not k % 2 else "")
            text.append(f"<|im_start|>assistant\n{turn}<|im_end|>\n" if k % 2 else user + "<|im_end|>\n")
    start = {"vicuna_v1": ("<s>" if tokenization == "llava" else "") + VICUNA + " ", "mistral_instruct": "<s>"}
    return start.get(template, SYSTEM) + "".join(text)
