"""InternVL 3.5 images (the Hugging Face port, ``InternVLForConditionalGeneration``): 448² tiles of a grid.

    size --closest grid (columns x rows, 1..12 tiles)--> tiles = columns * rows (+ 1 thumbnail if > 1)
    RGB PIL --resize to (448 columns, 448 rows)--> uint8 (3, 448 rows, 448 columns)   in workers, stored
            --resize to 448 x 448 (only if > 1 tile)--> uint8 (3, 448, 448)           the thumbnail, stored
    stored --cut 448² tiles row by row, thumbnail last, normalise--> float32 (tiles, 3, 448, 448)

Every tile is ``image_seq_length`` (256) language-model positions, ``<IMG_CONTEXT>`` each, the image's
run between ``<img>`` and ``</img>``: 256 x tiles + 2 positions. The model reads ``pixel_values``, every
image's tiles end to end in placeholder order, and scatters the tiles' features into the
``<IMG_CONTEXT>`` positions in order; its positions are the language model's plain 1-D ids, which
restart at every sample of a packed row.

The grid: of the grids of ``min_patches``..``max_patches`` tiles, the one whose columns / rows is
closest to the image's width / height; on a tie a later grid replaces the one held when the image's
area is over half the grid's. Candidates are tried by increasing tile count; within a tile count
two references order them differently, and ``arithmetic`` names the one to follow:

- "transformers" (default): ``GotOcr2ImageProcessorPil.get_optimal_tiled_canvas``, the processor of
  the ``-HF`` checkpoints (``InternVLProcessor`` always tiles: its ``crop_to_patches`` is on whatever
  the preprocessor_config.json says); columns outer, rows inner.
- "internvl": InternVL's own ``dynamic_preprocess`` (its chat and training scripts): the candidates
  as Python iterates a set of (columns, rows) tuples.

Within one tile count no two grids tie on the closest ratio when ``min_patches`` is 1 (a grid of
fewer tiles always lies between them; checked for every budget of up to 12 tiles), so with the released settings the two agree on every size;
they part on exact ties of budgets without the 1 x 1 grid (``min_patches`` = ``max_patches`` = 4: a 5 x 2
image is 1.5 from both 2 x 2 and 4 x 1, transformers keeps 2 x 2 and InternVL 4 x 1; tests/families/test_internvl.py
names such ties).

Several images in a sample: the HF processor tiles each image with the whole budget (``max_patches``)
whatever its sample holds, and so does this family under "transformers". Under "internvl" the budget is
shared as InternVL's own fine-tuning script shares it (``internvl_chat_finetune.py``,
``multi_modal_multi_image_get_item``): each of a record's n images gets ``max(1, max_patches // n)``
tiles at most (12 budget, 3 images: 4 each), so an image's count needs its sample's image count
(``counts_images_per_sample``; the sample builder passes ``sample_images``). A budget under
``min_patches`` leaves no grid to choose, and the image is one tile, as there.

Pixels are transformers' ``GotOcr2ImageProcessorPil`` (PIL resize, then its float ops), bit-identical
(tested over an image zoo): the stored uint8 image is the grid-sized resize the tiles are cut from,
the same bytes as the tiles, so nothing is resized on read.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image

from neva_pack.core import ConfigError
from neva_pack.families.base import EncoderSpec, FamilyBase, FamilyOptions, Join, processor_normalisation, refuse_layout_options
from neva_pack.families.headers import StoredImage, planar_uint8
from neva_pack.families.settings_keys import MAX_SIDE, Setting, check_keys, whole

__all__ = ["ARITHMETICS", "MAX_TILES", "InternVLProcessor", "TileSettings", "candidate_grids", "closest_grid", "tile_settings"]

MAX_TILES = 64
"""Most tiles of a grid a settings file may ask for (12 in every release; the candidate grids grow
with its square, InternVL's own order with its cube)."""

ARITHMETICS = ("transformers", "internvl")
"""Whose candidate order the grid choice follows (see the module's docstring)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TileSettings:
    """The numbers that decide an InternVL image's grid, tokens and pixels."""

    tile: int
    """Side of a tile and of the thumbnail in pixels (448)."""
    min_patches: int
    """Fewest tiles of a grid (1)."""
    max_patches: int
    """Most tiles of a grid (12); 1: every image is one tile, no thumbnail."""
    tokens_per_tile: int
    """Language-model positions of a tile (``image_seq_length``, 256: 1024 patches of 14, pixel-shuffled by 0.5)."""
    patches_per_tile: int
    """Vision-encoder patches of a tile (its attention's length: (448 / 14)² = 1024)."""
    resample: int
    """PIL resampling filter of both resizes (3, bicubic)."""


def tile_settings(encoder: EncoderSpec) -> TileSettings:
    """The settings of an InternVL encoder: the tile size, budget and filter of its
    preprocessor_config.json, the positions per tile of its processor_config.json (``model_config``)."""
    cfg, model = encoder.preprocessor_config, encoder.model_config
    size = cfg.get("size") or {}
    tile = int(size.get("height") or 448)
    if int(size.get("width") or tile) != tile:
        raise ConfigError(f"--hf_vision_encoder {encoder.name}: InternVL tiles are square; size is {size}")
    settings = TileSettings(
        tile=tile,
        min_patches=int(cfg.get("min_patches", 1)),
        max_patches=int(cfg.get("max_patches", 12)),
        tokens_per_tile=int(model.get("image_seq_length", 256)),
        patches_per_tile=(tile // encoder.patch_size) ** 2,
        resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
    )
    if not 1 <= settings.min_patches <= settings.max_patches:
        raise ConfigError(f"--hf_vision_encoder {encoder.name}: need 1 <= min_patches <= max_patches, got {settings.min_patches}, {settings.max_patches}")
    return settings


@lru_cache(maxsize=32)
def candidate_grids(min_patches: int, max_patches: int, arithmetic: str = "transformers") -> tuple[tuple[int, int], ...]:
    """(columns, rows) of every grid of ``min_patches``..``max_patches`` tiles, in the order ``arithmetic``'s
    reference tries them: by tile count, and within one tile count columns outer, rows inner
    ("transformers") or as Python iterates the set of them ("internvl"; the order of int tuples' hashes,
    the same in every run)."""
    grids = [(c, r) for c in range(1, max_patches + 1) for r in range(1, max_patches + 1) if min_patches <= c * r <= max_patches]
    if arithmetic == "internvl":
        grids = list({(c, r) for n in range(min_patches, max_patches + 1) for c in range(1, n + 1) for r in range(1, n + 1)
                      if min_patches <= c * r <= max_patches})  # fmt: skip
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def closest_grid(width: int, height: int, tile: int, grids: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(columns, rows) of the grid whose shape is closest to the image's (the module's docstring), trying
    ``grids`` in order as the references do: the reference's own loop, for ``_GridIndex`` to be held against."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for columns, rows in grids:
        diff = abs(aspect - columns / rows)
        if diff < best_diff:
            best, best_diff = (columns, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * columns * rows:
            best = (columns, rows)
    return best


class _GridIndex:
    """``closest_grid`` over one list of grids, the same answer in a few steps (a header's count is this
    choice; the loop over 35 grids costs more than PIL's reading of the header).

    ``abs(aspect - ratio)`` only grows away from the aspect on either side, so the closest ratios are the
    nearest one below and the nearest one at or above (found by bisection over the distinct ratios); the
    grids of the one (or both, on an exact tie) are the only ones the loop ever keeps, and among them it
    keeps the first in list order, replaced by each later one whose area the image's is over half of."""

    def __init__(self, grids: tuple[tuple[int, int], ...], tile: int):
        by_ratio: dict[float, list[tuple[int, int, int]]] = {}
        for k, (columns, rows) in enumerate(grids):
            by_ratio.setdefault(columns / rows, []).append((k, columns, rows))
        self.ratios = sorted(by_ratio)
        self.grids = [by_ratio[ratio] for ratio in self.ratios]
        self.half_tile_area = 0.5 * tile * tile

    def best(self, width: int, height: int) -> tuple[int, int]:
        aspect, area = width / height, width * height
        ratios = self.ratios
        at = bisect.bisect_left(ratios, aspect)
        if at == 0:
            tied = self.grids[0]
        elif at == len(ratios):
            tied = self.grids[-1]
        else:
            below, above = aspect - ratios[at - 1], ratios[at] - aspect
            if below == above:
                tied = sorted(self.grids[at - 1] + self.grids[at])
            else:
                tied = self.grids[at - 1] if below < above else self.grids[at]
        _, columns, rows = tied[0]
        for _, c, r in tied[1:]:
            if area > self.half_tile_area * c * r:
                columns, rows = c, r
        return columns, rows


class InternVLProcessor(FamilyBase):
    """InternVL 3.5 images: tile counts from sizes, uint8 in workers, the tiles as floats at read time."""

    family = "internvl"
    image_tokens = ("<img>", "<IMG_CONTEXT>", "</img>")
    """(start, patch, end) of an image run as the -HF tokenizers spell them: ``<img>``, 256 ``<IMG_CONTEXT>``
    per tile, ``</img>``."""
    models = "InternVL 3.5"
    option_names = ("arithmetic",)
    """Whose grid choice to follow ("transformers" or "internvl"), as ``options`` records it."""
    references = ARITHMETICS
    """``--image_reference``: the Hugging Face processor's grid choice, or InternVL's own."""
    batch_keys = {"pixel_values": Join.IMAGES}
    """Every image's tiles end to end: (sum of tiles, 3, 448, 448)."""

    def __init__(self, settings: TileSettings, normalisation, *, arithmetic: str = "transformers"):
        if arithmetic not in ARITHMETICS:
            raise ConfigError(f"InternVL arithmetic {arithmetic!r}: choose one of {', '.join(ARITHMETICS)}")
        self.settings = settings
        self.normalisation = normalisation
        """core.Normalisation: the processor's rescale factor, mean and std."""
        self.arithmetic = arithmetic
        self._grids = _GridIndex(candidate_grids(settings.min_patches, settings.max_patches, arithmetic), settings.tile)
        self._shared: dict[int, _GridIndex] = {}  # a shared budget (``sample_images`` over 1) -> its grids

    settings_keys = (
        Setting("size", f"an object of height and width, one square tile's side (1 to {MAX_SIDE:,} pixels)",
                lambda v: isinstance(v, dict) and set(v) == {"height", "width"} and v["height"] == v["width"] and 0 < v["height"] <= MAX_SIDE),
        whole("min_patches", 1, MAX_TILES, " (fewest tiles of a grid)"),
        whole("max_patches", 1, MAX_TILES, " (most tiles of a grid: 12 in every release)"),
    )  # fmt: skip
    """What the processor reads of a preprocessor_config.json beyond the common keys (settings_keys)."""

    @staticmethod
    def model_settings(directory, model_config: dict, read) -> dict:
        """Positions per tile from a checkpoint directory's processor_config.json (``image_seq_length``)."""
        processor_file = directory / "processor_config.json"
        processor_config = read(processor_file) if processor_file.exists() else {}
        check_keys(processor_config, processor_file, (whole("image_seq_length", 1, 1 << 14, " (positions per tile: 256)"),))
        found = processor_config.get("image_seq_length")
        return {} if found is None else {"image_seq_length": found}

    @classmethod
    def from_options(cls, encoder: EncoderSpec, options: FamilyOptions) -> InternVLProcessor:
        """The Hugging Face processor's grid choice (the -HF checkpoints'), or InternVL's own (``--image_reference``)."""
        refuse_layout_options(encoder, options)
        return cls.from_encoder(encoder, arithmetic=options.reference or "transformers")

    @classmethod
    def from_encoder(cls, encoder: EncoderSpec, *, arithmetic: str = "transformers") -> InternVLProcessor:
        normalisation = processor_normalisation(encoder, ("do_resize", "do_rescale", "do_normalize"))
        return cls(tile_settings(encoder), normalisation, arithmetic=arithmetic)

    def options(self) -> dict:
        """Whose grid choice the counts follow."""
        return {"arithmetic": self.arithmetic}

    @property
    def counts_images_per_sample(self) -> bool:
        """InternVL's own fine-tuning shares the tile budget among a record's images (the module's docstring)."""
        return self.arithmetic == "internvl" and self.settings.max_patches > 1

    def tile_budget(self, sample_images: int = 1) -> int:
        """Most tiles of one of ``sample_images`` images of a sample: ``max_patches``, or under "internvl"
        ``max(1, max_patches // sample_images)``."""
        if not self.counts_images_per_sample:
            return self.settings.max_patches
        return max(1, self.settings.max_patches // max(1, sample_images))

    def grid(self, width: int, height: int, *, sample_images: int = 1) -> tuple[int, int]:
        """(columns, rows) of the image's tiles (1 x 1 when its budget is 1, or under ``min_patches``: the
        processor then only resizes)."""
        s = self.settings
        budget = self.tile_budget(sample_images)
        if budget == 1 or budget < s.min_patches:
            return 1, 1
        if budget == s.max_patches:
            return self._grids.best(width, height)
        if budget not in self._shared:
            self._shared[budget] = _GridIndex(candidate_grids(s.min_patches, budget, self.arithmetic), s.tile)
        return self._shared[budget].best(width, height)

    def tiles(self, width: int, height: int, *, sample_images: int = 1) -> int:
        """Tiles the model reads of the image: the grid's, plus the thumbnail when the grid has more than one."""
        columns, rows = self.grid(width, height, sample_images=sample_images)
        return 1 if columns * rows == 1 else columns * rows + 1

    def tokens_for_size(self, width: int, height: int, *, sample_images: int = 1) -> int:
        """256 ``<IMG_CONTEXT>`` positions per tile (the run's ``<img>`` / ``</img>`` are the image run's)."""
        return self.tiles(width, height, sample_images=sample_images) * self.settings.tokens_per_tile

    def fewest_tokens(self) -> int:
        """The positions of the smallest grid: one tile (``min_patches`` 1), or ``min_patches`` tiles and the thumbnail."""
        s = self.settings
        if s.min_patches == 1 or self.counts_images_per_sample:  # a shared budget may come down to one tile
            return s.tokens_per_tile
        return s.tokens_per_tile * (s.min_patches + 1)

    def pixels_for_size(self, width: int, height: int, *, sample_images: int = 1) -> int:
        """Pixels of the grid-sized resize (the largest image the processor makes of it)."""
        columns, rows = self.grid(width, height, sample_images=sample_images)
        return columns * rows * self.settings.tile**2

    def vision_cost_for_size(self, width: int, height: int, *, sample_images: int = 1) -> int:
        """One encoder pass per tile, each of its 1024 patches squared."""
        return self.tiles(width, height, sample_images=sample_images) * self.settings.patches_per_tile**2

    def vision_cost_of_stored(self, size: tuple[int, int], parts: int, tokens: int) -> int:
        """The stored image's tiles (its tokens over a tile's), whatever budget its sample gave it."""
        return tokens // self.settings.tokens_per_tile * self.settings.patches_per_tile**2

    def to_uint8(self, image: Image.Image, *, sample_images: int = 1) -> StoredImage:
        """RGB image -> (the image resized to its grid,) or, for a grid of several tiles, (that, the
        448 x 448 thumbnail), uint8: the processor's two resizes, the tiles cut from the first on read."""
        s = self.settings
        width, height = image.size
        columns, rows = self.grid(width, height, sample_images=sample_images)
        resized = image.resize((columns * s.tile, rows * s.tile), resample=s.resample)
        parts = (planar_uint8(resized),)
        if columns * rows > 1:
            parts += (planar_uint8(image.resize((s.tile, s.tile), resample=s.resample)),)
        tokens = self.tiles(width, height, sample_images=sample_images) * s.tokens_per_tile
        return StoredImage(size=(width, height), parts=parts, tokens=tokens)

    def model_inputs(self, images: list[StoredImage]) -> dict[str, np.ndarray]:
        """``pixel_values`` float32 (sum of tiles, 3, 448, 448): each image's tiles row by row, then its
        thumbnail, as ``InternVLProcessor`` returns them for these images in this order."""
        t = self.settings.tile
        stacks = [self._tiles_uint8(image) for image in images]
        pixel_values = np.empty((sum(len(stack) for stack in stacks), 3, t, t), dtype=np.float32)
        start = 0
        for stack in stacks:
            self.normalisation.apply(stack, out=pixel_values[start : start + len(stack)])
            start += len(stack)
        return {"pixel_values": pixel_values}

    def sample_extras(self, tokens, images, num_images, patch_id) -> dict[str, np.ndarray]:
        """None; ValueError when the pack's ``<IMG_CONTEXT>`` positions are not its tiles' (the model
        would scatter features into the wrong places, or refuse the row)."""
        expected = sum(self._stored_tiles(image) for image in images) * self.settings.tokens_per_tile
        found = int((np.asarray(tokens) == patch_id).sum())
        if found != expected:
            raise ValueError(f"{found} <IMG_CONTEXT> positions in the pack, its images' tiles make {expected}")
        return {}

    def _stored_tiles(self, image: StoredImage) -> int:
        """Tiles of a stored image: its grid's (from the resize's shape), plus its thumbnail if it has one."""
        _, height, width = image.parts[0].shape
        return (height // self.settings.tile) * (width // self.settings.tile) + len(image.parts) - 1

    def _tiles_uint8(self, image: StoredImage) -> np.ndarray:
        """uint8 (tiles, 3, S, S): the grid's tiles row by row, then the thumbnail (a stored image of one part is one tile)."""
        t = self.settings.tile
        resized = image.parts[0]
        _, height, width = resized.shape
        rows, columns = height // t, width // t
        tiles = resized.reshape(3, rows, t, columns, t).transpose(1, 3, 0, 2, 4).reshape(-1, 3, t, t)
        if len(image.parts) == 1:
            return tiles
        return np.concatenate([tiles, image.parts[1][None]])
