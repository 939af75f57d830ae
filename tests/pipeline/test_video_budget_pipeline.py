"""--max_video_tokens_per_pack end to end: ``neva-pack preprocess`` on the video pipeline's records (clips,
a record of two clips and an image, images, text; the stand-in tokenizer) for Qwen2.5-VL. A sample's
video tokens are the positions of its clips' runs (the sample store's runs kept whole), counted in its
image tokens too; no pack holds more than the budget, a sample over it alone is a counted skip with
the visual budgets' reason, the meta and the stats record the budget, a resume with another one is refused, and
``neva-pack verify`` passes."""

from __future__ import annotations

import json

import numpy as np

from neva_pack.cli import main
from neva_pack.commands import verify
from neva_pack.files import paths
from neva_pack.formats import open_packed
from neva_pack.sample_store import SampleStore
from tests.families.test_video_native import QWEN2_5
from tests.pipeline import test_video_pipeline
from tests.pipeline.test_video_pipeline import RECORDS, run

workload = test_video_pipeline.workload
"""The video pipeline's records and media (its module fixture)."""

BUDGET = 27
"""One clip's run is 14 positions at these settings: two single-clip samples (28) never share a pack,
and the record of two clips (28 video positions) is over the budget alone."""


def test_no_pack_holds_more_video_tokens_than_the_budget_and_a_sample_over_it_is_skipped(workload, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(workload, QWEN2_5, out, 1, "--max_video_tokens_per_pack", str(BUDGET)) == 0
    store = SampleStore(paths.store_dir(out))
    video = dict(zip(store.rows["record_index"].tolist(), store.video_tokens().tolist()))
    image_tokens = dict(zip(store.rows["record_index"].tolist(), store.image_tokens.tolist()))
    ids = {k: record["id"] for k, record in enumerate(RECORDS)}
    assert {ids[k]: v for k, v in video.items()} == {"clip": 14, "mixed": 28, "text": 0, "image": 0, "again": 14}
    assert all(image_tokens[k] >= v for k, v in video.items()) and image_tokens[1] > video[1]  # clips are image tokens too

    prefix = paths.packed_prefix(out)
    reader = open_packed(out)
    assert reader.meta.max_video_tokens_per_pack == BUDGET
    assert json.loads(paths.meta_path(prefix).read_text())["max_video_tokens_per_pack"] == BUDGET
    plan = reader.plan_table()
    packs = [plan.record_index[plan.offsets[p] : plan.offsets[p + 1]].tolist() for p in range(len(plan.offsets) - 1)]
    assert sorted(k for pack in packs for k in pack) == [0, 2, 3, 4]  # all but the two-clip record
    assert max(sum(video[k] for k in pack) for pack in packs) <= BUDGET
    assert not any({0, 4} <= set(pack) for pack in packs)  # the two single clips: 28 > 27

    skipped = [json.loads(line) for line in paths.skipped_path_of(prefix).read_text().splitlines()]
    assert {(s["index"], s["reason"]) for s in skipped} == {(1, "over_image_budget"), (5, "video_truncated")}
    over = next(s for s in skipped if s["reason"] == "over_image_budget")
    assert "--max_video_tokens_per_pack 27" in over["detail"]
    assert json.loads((out / "stats.json").read_text())["records"]["skipped_by_reason"]["over_image_budget"] == 1
    assert verify(prefix, progress=False).ok
    visual = json.loads((out / "stats.json").read_text())["packing"]["visual"]  # stats report it, as the image budgets
    assert visual["max_video_tokens_per_pack"] == BUDGET and visual["video_tokens_per_pack"]["max"] == 14
    capsys.readouterr()
    assert main(["stats", str(out)]) == 0
    assert "video tokens mean 14.0   max 14   budget 27 (max at 51.9%" in capsys.readouterr().out

    capsys.readouterr()  # the budget is in the resume fingerprint: another one is refused, naming it
    assert run(workload, QWEN2_5, out, 1, "--max_video_tokens_per_pack", "40", "--resume") == 2
    assert "max_video_tokens_per_pack" in capsys.readouterr().err


def test_without_the_budget_the_single_clips_share_a_pack(workload, tmp_path):
    out = tmp_path / "out"
    assert run(workload, QWEN2_5, out, 1) == 0
    plan = open_packed(out).plan_table()
    assert np.array_equal(np.sort(plan.record_index), [0, 1, 2, 3, 4]) and len(plan.offsets) == 2  # one pack
    assert "max_video_tokens_per_pack" not in json.loads(paths.meta_path(paths.packed_prefix(out)).read_text())
    assert json.loads((out / "stats.json").read_text())["packing"]["visual"]["video_tokens_per_pack"] is None
