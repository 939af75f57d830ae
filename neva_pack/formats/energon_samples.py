"""An energon sample's members and the pack they make (the layout is formats/energon.py's docstring).

The writer's side: ``carried_members``, the members carrying the images a pack is the first of its
shard to use -- fixed crops as one uint8 (U, 3, H, W) array; dynamic-resolution images
(``images.StoredImage``) as their parts' bytes back to back, a row per image (size, tokens, parts)
and the (h, w) of each part. The reader's side: ``decode``, a raw sample as Energon yields it -> the
``ReadPack`` (Energon's sample loader, a cooker and our own reader all go through it). Either way an
image comes back exactly as it went in, known by the same content key as in the image pool.
"""

from __future__ import annotations

import numpy as np

from neva_pack.core import InputError, StoredImage
from neva_pack.formats.meta import ReadPack
from neva_pack.formats.webdataset import file_store_of, npy_array, npy_bytes
from neva_pack.sample_store import image_key

__all__ = [
    "DYNAMIC_CARRIED", "DYNAMIC_MEMBERS", "FIXED_CARRIED", "IMAGES_MEMBER", "IMAGE_LENGTHS_MEMBER", "IMAGE_REFS_MEMBER", "MEMBERS",
    "NOT_IN_SAMPLE", "carried_images", "carried_members", "decode", "fetch_from", "image_key", "pack_index", "sample_fields",
]  # fmt: skip

IMAGES_MEMBER = "images.npy"
IMAGE_INFO_MEMBER = "image_info.npy"
PART_SHAPES_MEMBER = "part_shapes.npy"
IMAGE_SECONDS_MEMBER = "image_seconds.npy"
FIXED_CARRIED = (IMAGES_MEMBER,)
"""The members a fixed-crop sample carries its images in."""
DYNAMIC_CARRIED = (IMAGES_MEMBER, IMAGE_INFO_MEMBER, PART_SHAPES_MEMBER, IMAGE_SECONDS_MEMBER)
"""The members a dynamic-resolution sample carries its images in, in the order they are written."""
INFO_COLUMNS = ("width", "height", "tokens", "parts", "frames")
"""The columns of ``image_info.npy``, one row per carried image (``frames``: 0 for a still image, a video
clip's frames stacked in its one part); ``image_seconds.npy`` float64 (U,): a clip's seconds per
temporal patch (0 for an image). A dataset written before clips has 4 columns and no seconds: stills."""
STILL_COLUMNS = 4
IMAGE_REFS_MEMBER = "image_refs.npy"
IMAGE_LENGTHS_MEMBER = "image_lengths.npy"
MEMBERS = ("tokens.npy", "labels.npy", "cu_seqlens.npy", "cu_seqlens_unpadded.npy", IMAGES_MEMBER, IMAGE_REFS_MEMBER)
"""The members of every sample of a fixed-crop dataset, in the order they are written."""
DYNAMIC_MEMBERS = (*MEMBERS[:4], *DYNAMIC_CARRIED[:1], IMAGE_REFS_MEMBER, *DYNAMIC_CARRIED[1:], IMAGE_LENGTHS_MEMBER)
"""The members of every sample of a dynamic-resolution dataset, in the order they are written."""


def carried_members(images: list, dynamic: bool, image_shape=None) -> dict[str, bytes]:
    """The members (name -> .npy bytes) carrying ``images``: uint8 (3, H, W) arrays of ``image_shape``
    (fixed), or StoredImages (dynamic)."""
    if not dynamic:
        carried = np.stack(images) if images else np.zeros((0, *image_shape), np.uint8)
        return {IMAGES_MEMBER: npy_bytes(carried)}
    parts = [np.ascontiguousarray(part, dtype=np.uint8) for image in images for part in image.parts]
    info = np.asarray([(*image.size, image.tokens, len(image.parts), image.frames) for image in images], np.int64)
    shapes = np.asarray([part.shape[1:] for part in parts], np.int64).reshape(-1, 2)
    pixels = np.concatenate([part.reshape(-1) for part in parts]) if parts else np.zeros(0, np.uint8)
    seconds = np.asarray([image.grid_seconds for image in images], np.float64)
    return {IMAGES_MEMBER: npy_bytes(pixels), IMAGE_INFO_MEMBER: npy_bytes(info.reshape(-1, len(INFO_COLUMNS))),
            PART_SHAPES_MEMBER: npy_bytes(shapes), IMAGE_SECONDS_MEMBER: npy_bytes(seconds)}  # fmt: skip


def carried_images(values: dict[str, np.ndarray], dynamic: bool) -> list:
    """The images a sample carries, from its members' arrays (``carried_members`` read back): the
    rows of the fixed array, or StoredImages whose parts are views of ``images.npy``. ValueError when
    the members do not describe each other."""
    pixels = values[IMAGES_MEMBER]
    if not dynamic:
        if pixels.ndim != 4 or pixels.dtype != np.uint8:
            raise ValueError(f"{IMAGES_MEMBER} of shape {pixels.shape} and dtype {pixels.dtype}, not uint8 (U, 3, H, W)")
        return list(pixels)
    info, shapes = values[IMAGE_INFO_MEMBER], values[PART_SHAPES_MEMBER]
    if pixels.ndim != 1 or pixels.dtype != np.uint8 or info.ndim != 2 or info.shape[1] not in (STILL_COLUMNS, len(INFO_COLUMNS)) or shapes.ndim != 2 or shapes.shape[1] != 2:
        raise ValueError(f"{IMAGES_MEMBER}, {IMAGE_INFO_MEMBER}, {PART_SHAPES_MEMBER} of shapes {pixels.shape}, {info.shape}, "
                         f"{shapes.shape}: not (bytes,), (U, {len(INFO_COLUMNS)}), (parts, 2)")  # fmt: skip
    if info.shape[1] == STILL_COLUMNS:  # written before video clips: every image a still one
        info = np.concatenate([info, np.zeros((len(info), 1), dtype=info.dtype)], axis=1)
    seconds = values.get(IMAGE_SECONDS_MEMBER, np.zeros(len(info)))
    if seconds.shape != (len(info),) or np.any(info[:, 4] < 0):
        raise ValueError(f"{IMAGE_SECONDS_MEMBER} of shape {seconds.shape} or frames {info[:, 4].tolist()} for {len(info)} images")
    counts = info[:, 3]
    if np.any(counts < 1) or int(counts.sum()) != len(shapes) or np.any(shapes < 1):
        raise ValueError(f"{IMAGE_INFO_MEMBER} lists {counts.tolist()} parts, {PART_SHAPES_MEMBER} {len(shapes)} part shapes")
    sizes = 3 * shapes[:, 0] * shapes[:, 1]
    if int(sizes.sum()) != len(pixels):
        raise ValueError(f"{IMAGES_MEMBER}: {len(pixels)} bytes, its parts' shapes need {int(sizes.sum())}")
    ends = np.cumsum(sizes)
    parts = [pixels[end - size : end].reshape(3, h, w) for (h, w), size, end in zip(shapes.tolist(), sizes.tolist(), ends.tolist())]
    images, first = [], 0
    for (width, height, tokens, count, frames), grid_seconds in zip(info.tolist(), seconds.tolist()):
        images.append(StoredImage(size=(width, height), parts=tuple(parts[first : first + count]), tokens=tokens,
                                  frames=frames, grid_seconds=grid_seconds))  # fmt: skip
        first += count
    return images


def _fetched(fetch, carrier: int, names) -> dict:
    """Another sample's members carrying its images (a dataset written before clips lacks image_seconds.npy)."""
    members = {}
    for name in names:
        try:
            members[name] = npy_array(fetch(f"{carrier:09d}.{name}"))
        except KeyError:
            if name != IMAGE_SECONDS_MEMBER:
                raise
    return members


def fetch_from(store):
    """``decode``'s ``fetch`` of an Energon ``FileStore`` (``WebdatasetFileStore``, a cooker's ``primary``):
    a member's content by its full name ``<key>.<part>``."""
    return lambda name: store[name][0]


def sample_fields(raw: dict) -> dict:
    """The ``PackSample`` fields of a raw sample (the dataset's ``sample_loader``): images other packs
    of the shard carry are read through Energon's file store of the dataset."""
    pack = decode(raw, fetch=lambda name: file_store_of(raw)[name][0])
    return {"pack": pack_index(raw), **{name: getattr(pack, name) for name in ReadPack.__dataclass_fields__ if name not in NOT_IN_SAMPLE}}


NOT_IN_SAMPLE = ("images",)
"""``ReadPack`` fields a ``PackSample`` does not carry (float images)."""


def pack_index(sample: dict) -> int:
    """The pack number of a sample Energon yields (its key)."""
    return int(sample["__key__"])


def decode(sample: dict, fetch=None) -> ReadPack:
    """The raw sample Energon yields (a dict of member bytes, or of arrays once Energon's decoder has
    read the ``.npy`` members) -> the pack, exactly as ``open_packed(...).pack(pack_index(sample))``.

    ``fetch(name)``: the content (bytes or array) of the member ``name`` (``<key>.images.npy``, and for
    dynamic-resolution images ``<key>.image_info.npy`` and ``<key>.part_shapes.npy``) of another sample
    of the dataset, for the images an earlier pack of the shard carries; needed only when the pack
    refers to one. The dataset's own ``dataset.yaml`` runs it in Energon's sample loader
    (samples come out as ``PackSample``); with a ``CrudeWebdataset`` dataset.yaml, cook the raw samples
    with a cooker that asks Energon for the primary dataset's file store::

        @cooker(need_primary=True)
        @stateless
        def cook(raw, primary):
            return decode(raw, fetch=fetch_from(primary))

        class PackEncoder(DefaultTaskEncoder):
            cookers = [Cooker(cook)]
    """
    dynamic = IMAGE_LENGTHS_MEMBER in sample
    carried = DYNAMIC_CARRIED if dynamic else FIXED_CARRIED
    try:
        values = {name: npy_array(sample[name]) for name in (DYNAMIC_MEMBERS if dynamic else MEMBERS)
                  if name != IMAGE_SECONDS_MEMBER or name in sample}  # a dataset written before clips has no seconds
    except KeyError as missing:
        raise InputError(f"sample {sample.get('__key__')!r}: no member {missing} (not a neva_pack energon sample)") from None
    refs, own, carriers = values[IMAGE_REFS_MEMBER].astype(np.int64).reshape(-1, 2).tolist(), pack_index(sample), {}
    for carrier, row in refs:
        if carrier not in carriers:
            if carrier != own and fetch is None:
                raise InputError(f"sample {sample['__key__']!r} uses images of pack {carrier}: decode it with a fetch (see decode)")
            members = values if carrier == own else _fetched(fetch, carrier, carried)
            try:
                carriers[carrier] = carried_images(members, dynamic)
            except ValueError as exc:
                raise InputError(f"sample {carrier:09d}: {exc}") from None
        if carrier > own or not 0 <= row < len(carriers[carrier]):
            raise InputError(f"sample {sample['__key__']!r} refers to image {row} of pack {carrier} (not an earlier pack's image)")
    images = [carriers[carrier][row] for carrier, row in refs]
    lengths = values[IMAGE_LENGTHS_MEMBER].astype(np.int64) if dynamic else None
    if dynamic and lengths.shape != (len(refs),):
        raise InputError(f"sample {sample['__key__']!r}: {len(refs)} images, image run lengths of shape {lengths.shape}")
    pixels = None
    if not dynamic:
        pixels = np.stack(images) if images else np.zeros((0, *values[IMAGES_MEMBER].shape[1:]), np.uint8)
    return ReadPack(
        cu_seqlens=values["cu_seqlens.npy"].astype(np.int64),
        cu_seqlens_unpadded=values["cu_seqlens_unpadded.npy"].astype(np.int64),
        tokens=values["tokens.npy"].astype(np.int64),
        labels=values["labels.npy"].astype(np.int64),
        pixels=pixels,
        images=None,
        num_images=len(refs),
        image_lengths=lengths,
        stored_images=images if dynamic else None,
    )
