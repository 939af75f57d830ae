"""What checking an output on open costs (neva_pack/formats/trust.py): ``open_packed`` with the checks
against the format's reader opened on the same meta without them, on an output of LLaVA-665K's scale
in packs and samples (compact format: its index holds the plan table and the offsets, per sample and per
pack, as big as they get). The bytes the check hashes are printed beside the output's size: the data
files are never read.

    PYTHONPATH=. python benchmarks/bench_open.py [--packs 150000] [--samples_per_pack 4] [--repeats 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from neva_pack.assembly import AssembledPack
from neva_pack.core import ImageRun
from neva_pack.files import meta_path, packed_prefix, paths
from neva_pack.formats import (
    Counts, FORMATS, ImageTokenIds, META_VERSION, Normalisation, PackedMeta, PackingSettings, WriteSpec,
    open_checked_meta, open_packed, read_meta
)
from neva_pack.packing import PlanTable
from neva_pack.sample_store import PoolWriter, pool_segment, segment_name

TOKENS_PER_SAMPLE = 6
"""Few ids per sample: the data files stay small, the index is as big as the counts make it."""


def write_output(directory: Path, packs: int, per_pack: int) -> None:
    store = paths.store_dir(directory)
    store.mkdir(parents=True)
    pool = PoolWriter(pool_segment(store, segment_name(0), 0), {}, 0)
    run = ImageRun(positions=2, patch_id=0, start_id=7)
    spec = WriteSpec(image_shape=(3, 2, 2), normalisation=Normalisation(rescale_factor=1 / 255, mean=(0.5,) * 3, std=(0.5,) * 3),
                     pad_id=0, ignore_index=-1, pool=(pool_segment(store, segment_name(0), pool.close()),), plan_digest="bench",
                     image_run=run)  # fmt: skip
    writer = FORMATS["compact"].writer(packed_prefix(directory), spec)
    lengths = np.full(per_pack, TOKENS_PER_SAMPLE, np.int64)
    tokens = np.tile(np.arange(1, TOKENS_PER_SAMPLE + 1, dtype=np.int32), per_pack)
    for p in range(packs):
        writer.add(AssembledPack(lengths=lengths, padded_lengths=lengths, tokens=tokens, labels=tokens,
                                 record_indices=np.arange(p * per_pack, (p + 1) * per_pack, dtype=np.int64),
                                 num_images=np.zeros(per_pack, np.int64), image_indices=np.zeros(0, np.int64),
                                 image_starts=np.zeros(0, np.int64), pixels=np.zeros((0, 3, 2, 2), np.uint8)))  # fmt: skip
    samples = packs * per_pack
    plan = PlanTable(offsets=np.arange(0, samples + 1, per_pack, dtype=np.int64), record_index=np.arange(samples, dtype=np.int64),
                     length=np.full(samples, TOKENS_PER_SAMPLE, np.int64), padded_length=np.full(samples, TOKENS_PER_SAMPLE, np.int64),
                     num_images=np.zeros(samples, np.int64))  # fmt: skip
    meta = PackedMeta(format="?", version=META_VERSION, num_packs=packs, image_shape=(3, 2, 2), normalisation=spec.normalisation,
                      dataset="bench.json", template="plain", tokenization="nemo", tokenizer="bench", vocab_size=16, encoder="bench",
                      image_aspect_ratio="square", image_positions=2, image_token_ids=ImageTokenIds(patch=0, start=7, end=None),
                      ignore_index=-1, pad_id=0,
                      packing=PackingSettings(pad_to_multiple_of=1, max_seq_length=4096, algorithm="bench", seed=0,
                                              max_samples_per_pack=None, balance_data_parallel=None),
                      counts=Counts(records=samples, samples=samples, skipped=0, truncated=0, packs=packs, images=0))  # fmt: skip
    writer.publish(plan, [], meta)


def best(seconds: list[float]) -> str:
    return f"{min(seconds) * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=150_000)
    parser.add_argument("--samples_per_pack", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        start = time.perf_counter()
        write_output(directory, args.packs, args.samples_per_pack)
        print(f"output: {args.packs:,} packs, {args.packs * args.samples_per_pack:,} samples (written in {time.perf_counter() - start:.1f} s)")
        prefix = packed_prefix(directory)
        meta = read_meta(meta_path(prefix))
        trusted = FORMATS["compact"].trusted_files(prefix, meta)
        hashed = sum(path.stat().st_size for path in trusted) + meta_path(prefix).stat().st_size
        listed = sum((directory / name).stat().st_size for name in meta.checksums)
        print(f"hashed on open: {hashed / 1e6:.2f} MB ({', '.join(p.name for p in trusted)} + the meta); "
              f"the output's files: {listed / 1e6:.2f} MB (data files not read)")  # fmt: skip
        checks, opens, unchecked = [], [], []
        for _ in range(args.repeats):  # page cache warm for all, as a training job's second open finds it
            t = time.perf_counter()
            open_checked_meta(prefix)
            checks.append(time.perf_counter() - t)
            t = time.perf_counter()
            open_packed(directory).plan_table()
            opens.append(time.perf_counter() - t)
            t = time.perf_counter()
            FORMATS["compact"].reader(prefix, read_meta(meta_path(prefix))).plan_table()
            unchecked.append(time.perf_counter() - t)
        print(f"the checks alone: {best(checks)}; open + plan table: {best(opens)} checked, {best(unchecked)} without "
              f"the checks (best of {args.repeats})")  # fmt: skip

if __name__ == "__main__":
    main()
