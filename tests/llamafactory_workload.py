"""The workload of the llamafactory golden data: the sample records through neva_pack into a
``--output_format llamafactory`` directory (tests/test_llamafactory_format.py runs it; the golden
generator, tests/golden/llamafactory/run_llamafactory.py, reads what ``build`` writes).

Qwen cases: the stand-in Qwen2 tokenizer of tests/golden/dynamic (no hub here), with ``<|endoftext|>``
as its pad token, as Qwen's own; the encoder is the shipped Qwen2.5-VL / Qwen3-VL settings with
--max_pixels at LLaMA-Factory's default image_max_pixels (768 * 768).

The LLaVA-1.5 case: a LLaMA-family tokenizer as LLaVA-1.5's is (tests/golden/llamafactory/llava_tokenizer:
the sample SentencePiece model as transformers' ``LlamaTokenizer`` converts it, ``legacy=False``, with
``<image>`` added; README there), the shipped CLIP ViT-L/14-336 settings (576 positions an image, its
``<image>`` id each), the v1 (Vicuna) template, which LLaMA-Factory's ``llava`` template renders alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import SAMPLE_DATA

TOKENIZER = Path(__file__).parent / "golden" / "dynamic" / "tokenizer.json"
LLAVA_TOKENIZER = Path(__file__).parent / "golden" / "llamafactory" / "llava_tokenizer"
ENCODERS = {"qwen2_5_vl": ("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_vl"), "qwen3_vl": ("Qwen/Qwen3-VL-2B-Instruct", "qwen3_vl"),
            "llava": ("openai/clip-vit-large-patch14-336", "v1")}  # fmt: skip
"""Golden case -> (--hf_vision_encoder, --conv_template); LLaMA-Factory's template of the same name (``llava`` for v1)."""
MAX_SEQ_LENGTH = 1024
LLAVA_MAX_SEQ_LENGTH = 2048
"""Two or three LLaVA images (576 positions each) a pack."""
LLAVA_IMAGE_ID = 990
"""``<image>`` in the LLaVA tokenizer: the id of every position of an image run, as LLaVA-1.5's processor writes it."""
MAX_PIXELS = 768 * 768
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL's chat template (ChatML, the default system block, an image as its three tokens) for the stand-in
tokenizer, which has none (the
automodel and megatron_bridge golden drivers give it to their processors); Qwen3-VL's is its released one (tests/golden/qwen3_vl/chat_template.jinja)."""


def records() -> list[dict]:
    """The sample records LLaMA-Factory's sharegpt reader accepts as they are: single-answer
    conversations (an odd number of prompts is refused by it), RGB images."""
    rows = json.loads((SAMPLE_DATA / "llava_sample.json").read_text())
    return [r for r in rows if len(r["conversations"]) % 2 == 0 and r.get("image") != "logo.png"]


def media_first(record: dict) -> bool:
    """No image, or one opening the first turn (``<image>\\n...``): where Bridge's encoder puts a sample's
    media (all of them first, then the turn's text: two images of one turn render otherwise than ours)."""
    count = sum(turn["value"].count("<image>") for turn in record["conversations"])
    return count == 0 or (count == 1 and record["conversations"][0]["value"].startswith("<image>\n"))


def build(root: Path, case: str = "qwen2_5_vl", output_format: str = "llamafactory", max_pixels: int | None = MAX_PIXELS,
          keep=None, image_reference: str | None = None) -> Path:
    """``root``/tok (tokenizer), ``root``/data.json (LLaVA records), ``root``/lf_data.json (the same in
    LLaMA-Factory's sharegpt layout, ``images`` a list), ``root``/out (our output, in ``output_format``).
    ``max_pixels`` None: the encoder's own bound (the reference's); ``keep(record)``: which records to use
    (default all); ``image_reference``: the run's --image_reference (None: none given). Returns ``root``/out."""
    from neva_pack.cli import main

    encoder, template = ENCODERS[case]
    root.mkdir(parents=True, exist_ok=True)
    tok = root / "tok"
    tok.mkdir(exist_ok=True)
    if case == "llava":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(LLAVA_TOKENIZER / name, tok / name)
    else:
        shutil.copy(TOKENIZER, tok / "tokenizer.json")
        (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                               "tokenizer_class": "Qwen2Tokenizer"}))  # fmt: skip
    rows = [r for r in records() if keep is None or keep(r)]
    (root / "data.json").write_text(json.dumps(rows))
    lf_rows = [{"conversations": r["conversations"],
                "images": [] if "image" not in r else [r["image"]] if isinstance(r["image"], str) else r["image"]} for r in rows]  # fmt: skip
    (root / "lf_data.json").write_text(json.dumps(lf_rows))
    out = root / "out"
    args = ["preprocess", "--quiet", "--data_path", str(root / "data.json"), "--image_folder", str(SAMPLE_DATA / "images"),
            "--tokenizer_path", str(tok), "--hf_vision_encoder", encoder, "--conv_template", template,
            "--output_format", output_format, "--output_dir", str(out), "--num_workers", "0", "--overwrite"]  # fmt: skip
    if case == "llava":  # fixed crops: no resize bounds
        args += ["--max_seq_length", str(LLAVA_MAX_SEQ_LENGTH), "--image_patch_id", str(LLAVA_IMAGE_ID)]
    else:
        args += ["--max_seq_length", str(MAX_SEQ_LENGTH)] + ([] if max_pixels is None else ["--max_pixels", str(max_pixels)])
    if image_reference is not None:
        args += ["--image_reference", image_reference]
    assert main(args) == 0
    return out


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1]), *sys.argv[2:]))
