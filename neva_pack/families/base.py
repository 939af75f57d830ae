"""The one interface every model family offers, and the vocabulary it is spoken in.

A model family (a fixed crop, tiles of a grid, native resolution, ...) decides everything about its
images: how an image run is spelled with the model's own tokens, how many positions an image of a
given size takes, how an image is stored (uint8 parts), what the model reads for a pack (pixel
tensors and per-image metadata under the model's own key names), how those keys join across a
batch, which positions the tokens get, and what the vision encoder costs. Everything outside
``families/`` asks the family object (``ModelFamily``) through this interface and never names a
family, so that a new family is one module plus one registry line (registry.py).

This module names no family: it is what the family modules and their callers share.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Protocol

import numpy as np

from neva_pack.core import ConfigError, ImageRun, Normalisation, StoredImage

__all__ = ["CLIP_MEAN", "CLIP_STD", "AttentionNeeds", "EncoderSpec", "FamilyBase", "FamilyOptions", "Join", "ModelFamily", "RunRequest", "VideoPlan", "VideoRequest", "fused_normalisation", "model_image_run", "processor_normalisation", "refuse_layout_options",
           "restarting_positions", "run_starts"]  # fmt: skip


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
"""OpenAI CLIP's per-channel mean (transformers' OPENAI_CLIP_MEAN): the default of the processors
whose settings leave ``image_mean`` out (CLIP's, Qwen2-VL's)."""
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""OpenAI CLIP's per-channel std (OPENAI_CLIP_STD), the same processors' default ``image_std``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderSpec:
    """A vision encoder's processor settings, as shipped (families/shipped) or read from a checkpoint."""

    name: str
    """Hub name of a shipped encoder, or the local directory it was read from."""
    processor: str
    """Which transformers image processor applies the settings (registry.PROCESSOR_FAMILIES lists them)."""
    family: str
    """The family module that processes this encoder's images (registry.PROCESSOR_FAMILIES of ``processor``)."""
    preprocessor_config: dict
    """The processor's settings, as in a preprocessor_config.json."""
    patch_size: int
    """Vision transformer patch size in pixels."""
    model_config: dict = field(default_factory=dict)
    """What the image's token count needs beyond the processor's settings, with transformers' names
    (from the model's config.json and processor_config.json); empty for a family that needs none."""


class Join(enum.Enum):
    """How one of a family's model-input keys joins the packs of a batch (training/ reads it): every
    key is laid end to end along its first dimension, in placeholder order, and kept whole on every
    context-parallel rank (the vision encoder runs over the batch's images before the sequence is split)."""

    IMAGES = "images"
    """One entry per image; trailing dimensions zero-padded to the batch's largest first (a family
    whose images have different tile counts pads them, as its processor pads a batch)."""
    SAMPLES = "samples"
    """One entry per sample of the pack (which images of a sample the model reads together)."""
    TOKENS = "tokens"
    """One entry per token position of the pack, laid end to end as the tokens are (a per-token
    model input, such as which positions are image tokens); a fixed row's extra padding is zeros."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionNeeds:
    """What a family's language model needs of attention beyond causal masking within each sample:
    training/ reads it to build the masks that give it (hf.py) or to refuse a batch whose kernels
    cannot express it (thd.py)."""

    bidirectional_images: bool = False
    """Each image's run of feature tokens (``marks``) attends both ways within itself, never outside
    its sample."""
    layer_types: tuple[str, ...] = ()
    """The model's layer types (its config's ``layer_types`` names) that do; the others stay causal."""
    marks: str = ""
    """The ``Join.TOKENS`` model input that marks image tokens (nonzero): each maximal run of marked
    positions is one image's block."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRequest:
    """What the user asked of the image run's ids (the command line's image options); a family
    spells its run from these and the tokenizer (``ModelFamily.image_run``)."""

    patch_id: int | None = None
    start_id: int | None = None
    end_id: int | None = None
    use_im_start_end: bool = False
    """A fixed-length run with its start and end added to the encoder's positions (NeMo)."""
    tokenization: str | None = None
    """The tokenization convention (text.TOKENIZATIONS); None: the default."""
    patch_token: str | None = None
    """The template's image patch token, when it names one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyOptions:
    """The command line's image options, as a family is built from them (``registry.model_family``);
    each family takes the ones it has and refuses, in one line, those it cannot honour."""

    aspect_ratio: str = "square"
    """``--image_aspect_ratio``: square (resize + crop) or pad (to a square first)."""
    max_image_pixels: int | None = None
    """``--max_image_pixels``; None: the default budget."""
    crop_size: tuple[int, int] | None = None
    """A crop size the settings file asks for, which the encoder's processor must agree with."""
    use_im_start_end: bool = False
    """``--use_im_start_end``: start and end added to a fixed-length run."""
    tokenization: str | None = None
    """The tokenization convention (text.TOKENIZATIONS); None: the default."""
    min_pixels: int | None = None
    """``--min_pixels``: smallest resized area, for a family that resizes each image to its own size."""
    max_pixels: int | None = None
    """``--max_pixels``: largest resized area, likewise."""
    max_soft_tokens: int | None = None
    """``--max_soft_tokens``: the feature tokens an image may take at most, for a family resizing each
    image to a token budget."""
    reference: str | None = None
    """``--image_reference``: whose preprocessing the counts and pixels follow, for a family that offers a
    choice (``ModelFamily.references``); None: the Hugging Face processor's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoRequest:
    """What the user asked of video clips (``--video_profile``, ``--video_fps``, ``--video_max_frames``,
    or a profile that turns ``cap_pixels_per_frame`` on); a family that reads videos resolves the rest from its settings."""

    profile: str = "hf"
    """Whose arithmetic samples and sizes the clips (the family's profiles; ``hf``: transformers', ``hf_cap``:
    theirs with ``cap_pixels_per_frame``)."""
    fps: float | None = None
    """Frames sampled per second of video; None: the profile's default."""
    max_frames: int | None = None
    """Frames sampled at most from one clip; None: the profile's default."""
    cap_pixels_per_frame: bool = False
    """transformers' ``cap_pixels_per_frame`` (its ``hf`` profile only): each frame's share of a whole-clip budget."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoPlan:
    """A clip laid out from its header alone (``ModelFamily.plan_video``): nothing decoded."""

    indices: tuple[int, ...]
    """The frames kept, increasing, numbered in decode (presentation) order."""
    size: tuple[int, int]
    """(height, width) every kept frame is resized to."""
    tokens: int
    """Video feature positions in the language model (the run's pad ids)."""
    ids: np.ndarray
    """int64: the clip's whole run of ids, delimiters and any timestamp text included."""
    grid_seconds: float
    """Seconds per temporal patch (0 where the model reads none)."""
    cost: int
    """The vision encoder's attention cost of the clip (patches² summed over its passes)."""
    resize: str = "v2"
    """Which torchvision resize the reference runs on the uint8 frames (``video_frames.decode_frames``):
    "v2" (``transforms.v2.functional``, transformers') or "v1" (``transforms.functional``, whose uint8
    bicubic differs by up to tens of levels)."""


class ModelFamily(Protocol):
    """One model family's images, from a record's image file to the model's inputs.

    Sizes are (width, height) as an image file's header gives them. ``sample_images`` (a keyword,
    given only to a family that ``counts_images_per_sample``, and only when over 1) is how many images
    the image's sample holds."""

    family: str
    """The family's name, as an output's meta records it (registry.FAMILIES' key)."""
    models: ClassVar[str]
    """The models of the family, as an error message names them."""
    image_tokens: ClassVar[tuple[str | None, str | None, str | None]]
    """(start, patch, end) tokens an image run is spelled with, None where the family has none."""
    option_names: ClassVar[tuple[str, ...]]
    """The family's own options (``FamilyOptions`` fields and ``dynamic_processor`` keywords) that
    decide its counts, recorded with an output (``options``)."""
    own_size: ClassVar[bool]
    """Each image is stored at its own size (a format that holds one image shape cannot hold them)."""
    references: ClassVar[tuple[str, ...]]
    """The references its counts and pixels can follow (``--image_reference``), the Hugging Face
    processor's ("transformers") first; empty: its processor's only, the flag refused."""
    counts_images_per_sample: bool
    """Whether an image's count and stored parts depend on how many images its sample holds."""
    stored_shape: tuple[int, int, int] | None
    """The one (3, H, W) every stored image has (a fixed crop); None: each image at its own size."""
    model_normalisation: Normalisation
    """The processor's rescale and normalisation, which readers apply to the stored uint8 pixels."""
    batch_keys: ClassVar[Mapping[str, Join]]
    """The model-input keys ``model_inputs`` and ``sample_extras`` give, each with how it joins a batch."""
    attention: ClassVar[AttentionNeeds]
    """What its language model's attention needs beyond causal masking within each sample."""

    @classmethod
    def from_options(cls, encoder: EncoderSpec, options: FamilyOptions) -> ModelFamily:
        """The family object for the encoder and the command line's options (ConfigError for an
        option it cannot honour)."""

    def image_run(self, tokenizer, request: RunRequest) -> ImageRun:
        """The ids an image run is written with, for this tokenizer (ConfigError, one line, when it
        lacks the model's image tokens)."""

    def tokens_for_size(self, width: int, height: int) -> int:
        """Sequence positions of an image of this size: arithmetic only, nothing decoded."""

    def pixels_for_size(self, width: int, height: int) -> int:
        """Pixels of the largest image the family makes of one of this size (a pixel budget's measure)."""

    def fewest_tokens(self) -> int:
        """A lower bound of ``tokens_for_size`` over every size (exact where the family knows it): no
        image of any size takes fewer positions (an image run's delimiters not counted)."""

    def vision_cost_for_size(self, width: int, height: int) -> int:
        """The vision encoder's attention cost of an image of this size, in patches² per encoder pass."""

    def vision_cost_of_stored(self, size: tuple[int, int], parts: int, tokens: int) -> int:
        """``vision_cost_for_size`` of an image as a pool records it (its size, number of parts and tokens)."""

    def to_uint8(self, image) -> StoredImage:
        """RGB PIL image -> its stored uint8 parts (the worker's half): a StoredImage, or for a family
        of one crop (``own_size`` False) the one uint8 (3, H, W) array the formats stack."""

    def model_inputs(self, images: list[StoredImage]) -> dict[str, np.ndarray]:
        """Stored images, in sample order -> the model's pixel tensors and per-image metadata under the
        model's own key names, bit-identical to transformers' processor (a family of one crop: from
        its uint8 (N, 3, H, W) stack)."""

    def sample_extras(self, tokens: np.ndarray, images: list[StoredImage], num_images: np.ndarray, patch_id: int) -> dict[str, np.ndarray]:
        """The per-sample inputs the model needs beyond the images' (keyed as ``batch_keys``), after
        checking the pack's images are stored as the model will read them (ValueError otherwise)."""

    def position_ids(self, tokens: np.ndarray, cu_seqlens: np.ndarray, real_lengths: np.ndarray, num_images: np.ndarray,
                     inputs: dict[str, np.ndarray], patch_id: int) -> np.ndarray:  # fmt: skip
        """int64 positions of a pack: (L,) restarting at every sample, or (rows, L), each sample's as if
        alone and its padding continuing from its largest id + 1."""

    def options(self) -> dict:
        """The family's own options as resolved (what rebuilds it with the encoder: registry.processor_record)."""

    settings_patch_size: ClassVar[bool]
    """A checkpoint's preprocessor_config.json names the patch size (read before its config.json's)."""
    settings_keys: ClassVar[tuple]
    """The keys of a preprocessor_config.json the family reads beyond the common ones
    (settings_keys.COMMON_SETTINGS), each with what it may hold (settings_keys.Setting): checked
    before ``check_settings_file``, a bad one refused in one line naming the file and the key."""

    takes_videos: bool
    """Whether the family reads video clips (after ``with_videos``); a record with a video is skipped otherwise."""

    def with_videos(self, request: VideoRequest, tokenizer) -> ModelFamily:
        """The family reading video clips as ``request`` asks, their runs spelled with ``tokenizer``'s
        ids (ConfigError, one line, for a family that reads none or a tokenizer lacking its tokens)."""

    def plan_video(self, frame_count: int, fps: float, width: int, height: int, tokenizer, *, duration_s: float | None = None) -> VideoPlan:
        """A clip's frames, size, run and cost from its header's numbers (ValueError for a clip the
        reference refuses: too short, an aspect ratio over 200). ``duration_s``: the stream's duration
        as FFmpeg reports it (None: it reports none), for a profile that samples by it."""

    def video_to_stored(self, frames: np.ndarray, plan: VideoPlan, size: tuple[int, int]) -> StoredImage:
        """uint8 (T, 3, h, w) kept frames -> the clip's stored form (``size``: the header's (width, height))."""

    @staticmethod
    def check_settings_file(settings: dict, processor: str, path) -> None:
        """ConfigError, one line, for a checkpoint's preprocessor_config.json the family cannot honour."""

    @staticmethod
    def model_settings(directory, model_config: dict, read) -> dict:
        """What the family's counts need beyond the processor's settings, read from a checkpoint
        directory (``read``: a JSON file -> dict, within the settings budget): ``EncoderSpec.model_config``."""


class FamilyBase:
    """What most families answer alike (base.ModelFamily's defaults): a family module's class derives
    from it and decides the rest; what it decides otherwise, it overrides."""

    option_names: ClassVar[tuple[str, ...]] = ()
    own_size: ClassVar[bool] = True
    references: ClassVar[tuple[str, ...]] = ()
    counts_images_per_sample = False
    settings_patch_size: ClassVar[bool] = False
    settings_keys: ClassVar[tuple] = ()
    attention: ClassVar[AttentionNeeds] = AttentionNeeds()
    takes_videos = False

    def with_videos(self, request: VideoRequest, tokenizer):
        """None: the family reads no video."""
        raise ConfigError(f"video clips: {self.models} reads no video (a native-resolution encoder does)")

    def plan_video(self, frame_count, fps, width, height, tokenizer, *, duration_s=None) -> VideoPlan:
        raise ValueError(f"{self.models} reads no video")

    def video_to_stored(self, frames, plan, size) -> StoredImage:
        raise ValueError(f"{self.models} reads no video")

    def options(self) -> dict:
        """None of its own."""
        return {}

    @property
    def stored_shape(self) -> tuple[int, int, int] | None:
        """The one (3, H, W) every stored image has, or None: each image at its own size."""
        return None

    @property
    def model_normalisation(self):
        """The processor's rescale and normalisation (core.Normalisation) the readers apply to the uint8 pixels."""
        return self.normalisation

    def image_run(self, tokenizer, request: RunRequest) -> ImageRun:
        """The model's own (start, patch, end) tokens from the tokenizer (``model_image_run``)."""
        return model_image_run(tokenizer, self.image_tokens, self.models, request)

    def fewest_tokens(self) -> int:
        """One: every image takes a position (a family whose smallest image takes more says so)."""
        return 1

    def vision_cost_of_stored(self, size: tuple[int, int], parts: int, tokens: int) -> int:
        """The image's size decides its cost, however it is stored."""
        return self.vision_cost_for_size(*size)

    def sample_extras(self, tokens, images, num_images, patch_id) -> dict[str, np.ndarray]:
        """None: every image is read alike, whatever its sample holds."""
        return {}

    def position_ids(self, tokens, cu_seqlens, real_lengths, num_images, inputs, patch_id) -> np.ndarray:
        """(L,): 0, 1, ... restarting at every sample, its padding included."""
        return restarting_positions(cu_seqlens)

    @staticmethod
    def check_settings_file(settings: dict, processor: str, path) -> None:
        """Any settings the processor reads will do."""

    @staticmethod
    def model_settings(directory, model_config: dict, read) -> dict:
        """None beyond the processor's settings."""
        return {}


def model_image_run(tokenizer, tokens: tuple[str | None, str, str | None], models: str, request: RunRequest) -> ImageRun:
    """The image run of a family whose images each have their own length, spelled with the model's
    (start, patch, end) tokens from the tokenizer; an id given explicitly replaces the token's.
    ConfigError, one line, for a tokenizer lacking one (``models`` names the family's models in it)."""
    ids = []
    for token, explicit in zip(tokens, (request.start_id, request.patch_id, request.end_id)):
        found = explicit if explicit is not None or token is None else tokenizer.token_to_id(token)
        if found is None and token is not None:
            wanted = "/".join(t for t in tokens if t is not None)
            raise ConfigError(
                f"tokenizer {tokenizer.name} has no {token}: a {models} image is spelled with "
                f"{wanted}; use the model's own tokenizer (or give the ids: --image_patch_id/--image_start_id/--image_end_id)"
            )
        ids.append(found)
    start, patch, end = ids
    return ImageRun(positions=None, patch_id=patch, start_id=start, end_id=end)


def refuse_layout_options(encoder: EncoderSpec, options: FamilyOptions) -> None:
    """A family whose processor lays each image out itself cannot honour a fixed crop's layout options."""
    if options.use_im_start_end or options.aspect_ratio != "square":
        raise ConfigError(
            f"--use_im_start_end / --image_aspect_ratio: {encoder.name}'s processor decides how its images are laid out"
        )



def processor_normalisation(encoder: EncoderSpec, steps: tuple[str, ...], mean=None, std=None) -> Normalisation:
    """The rescale and normalisation an encoder's settings ask of its processor, after checking that
    each of ``steps`` (``do_resize``, ``do_rescale``, ...) is on: a family whose exactness assumes a step
    refuses settings that turn it off, in one line. ``mean`` / ``std``: the processor class's defaults,
    for settings that leave them out."""
    cfg = encoder.preprocessor_config
    if not all(cfg.get(key, True) for key in steps):
        raise ConfigError(f"--hf_vision_encoder {encoder.name}: {', '.join(steps[:-1])} and {steps[-1]} must be on")
    for key, default in (("image_mean", mean), ("image_std", std)):
        if key not in cfg and default is None:
            raise ConfigError(f"--hf_vision_encoder {encoder.name}: its settings have no {key}")
    return Normalisation(
        rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
        mean=tuple(float(v) for v in cfg.get("image_mean", mean)),
        std=tuple(float(v) for v in cfg.get("image_std", std)),
    )

def fused_normalisation(encoder: EncoderSpec, mean, std) -> Normalisation:
    """The encoder's rescale and normalisation fused into one, as transformers' video processors apply
    them: rescale factor 1, the mean and std each float32(value) x float32(1 / rescale), so that a uint8
    value v becomes ``(v - 255 mean) / (255 std)`` in float32. ``mean`` / ``std``: the processor class's
    defaults, for settings that leave them out."""
    cfg = encoder.preprocessor_config
    rescale = float(cfg.get("rescale_factor", 1 / 255))

    def fused(values) -> tuple[float, float, float]:
        return tuple(float(v) for v in (np.asarray(values, dtype=np.float32) * np.float32(1.0 / rescale)))

    return Normalisation(rescale_factor=1.0, mean=fused(cfg.get("image_mean", mean)), std=fused(cfg.get("image_std", std)))


def run_starts(mask: np.ndarray) -> list[int]:
    """Where each maximal run of True in a bool mask starts (a family's runs of placeholder tokens):
    [F, T, T, F, T] -> [1, 4]."""
    return np.flatnonzero(np.diff(np.concatenate(([False], mask)).astype(np.int8)) == 1).tolist()


def restarting_positions(cu_seqlens: np.ndarray) -> np.ndarray:
    """int64 positions 0, 1, ... restarting at every boundary: [0, 3, 5] -> [0, 1, 2, 0, 1]."""
    bounds = np.asarray(cu_seqlens, dtype=np.int64)
    sizes = np.diff(bounds)
    return np.arange(int(bounds[-1]), dtype=np.int64) - np.repeat(bounds[:-1], sizes)
