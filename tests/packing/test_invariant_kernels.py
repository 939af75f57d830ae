"""The compiled yes/no (invariant_kernels.pack_is_sound) agrees with invariants.pack_problems on
every pack: sound ones, and the same packs with one thing broken (a token, a label, a boundary, a
length, the image count), for every kind of image run."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from neva_pack.packing import PackSpec, fast_pack_problems, pack_is_sound, pack_problems
from neva_pack.core import ImageRun

IGNORE, PAD, PATCH = -100, 0, 3
RUNS = {  # name: (positions, start id, end id)
    "start+end": (4, 1, 2),
    "end only": (3, None, 2),
    "patches only": (3, None, None),
    "no images": (0, None, None),
}


@st.composite
def packs(draw):
    positions, start, end = RUNS[draw(st.sampled_from(sorted(RUNS)))]
    spec = PackSpec(max_seq_length=draw(st.integers(8, 200)), ignore_index=IGNORE, pad_id=PAD,
                    image_run=ImageRun(positions=positions, patch_id=PATCH, start_id=start, end_id=end))  # fmt: skip
    run = spec.image_run.ids().tolist() if positions else []
    multiple = draw(st.sampled_from([1, 1, 4]))
    tokens, labels, cu, real, images = [], [], [0], [], 0
    for _ in range(draw(st.integers(1, 4))):
        ids = []
        for part in draw(st.lists(st.sampled_from(["text", "image"] if run else ["text"]), min_size=1, max_size=4)):
            if part == "image":
                ids += run
                images += 1
            else:
                ids += draw(st.lists(st.integers(10, 40), min_size=1, max_size=6))
        trained = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
        sample_labels = [ids[k + 1] if trained[k] and k + 1 < len(ids) and ids[k + 1] >= 10 else IGNORE for k in range(len(ids))]
        sample_labels[-1] = draw(st.sampled_from([IGNORE, 11, 12]))  # a sample's last label is its next id
        padded = -(-len(ids) // multiple) * multiple
        tokens += ids + [PAD] * (padded - len(ids))
        labels += sample_labels + [IGNORE] * (padded - len(ids))
        real.append(len(ids))
        cu.append(cu[-1] + padded)
    return spec, np.array(cu), np.array(tokens, np.int32), np.array(labels, np.int32), images, np.array(real)


def _agree(spec, cu, tokens, labels, images, real):
    problems = pack_problems(spec, cu, tokens, labels, images, real_lengths=real)
    assert pack_is_sound(spec, cu, tokens, labels, images, real_lengths=real) == (not problems), problems
    assert fast_pack_problems(spec, cu, tokens, labels, images, real_lengths=real) == problems


@settings(max_examples=150, deadline=None)
@given(pack=packs())
def test_sound_packs_are_sound_for_both(pack):
    spec, cu, tokens, labels, images, real = pack
    if len(tokens) <= spec.max_seq_length:  # the generator can overfill a small capacity: then both refuse it
        assert pack_problems(spec, cu, tokens, labels, images, real_lengths=real) == []
    _agree(*pack)


@settings(max_examples=400, deadline=None)  # ~65 per kind of break
@given(pack=packs(), what=st.sampled_from(["token", "label", "cu", "real", "images", "no real"]), data=st.data())
def test_a_broken_pack_is_judged_alike(pack, what, data):
    spec, cu, tokens, labels, images, real = pack
    cu, tokens, labels, real = cu.copy(), tokens.copy(), labels.copy(), real.copy()
    if what == "token":
        tokens[data.draw(st.integers(0, len(tokens) - 1))] = data.draw(st.sampled_from([0, 1, 2, 3, 11, 39]))
    elif what == "label":
        labels[data.draw(st.integers(0, len(labels) - 1))] = data.draw(st.sampled_from([IGNORE, 0, 3, 11, 39]))
    elif what == "cu":
        cu[data.draw(st.integers(0, len(cu) - 1))] += data.draw(st.sampled_from([-2, -1, 1, 2]))
    elif what == "real":
        real[data.draw(st.integers(0, len(real) - 1))] += data.draw(st.sampled_from([-3, -1, 1, 3]))
    elif what == "images":
        images += data.draw(st.sampled_from([-1, 1]))
    else:
        real = None  # no padding information: every position up to a boundary is the sample's
    _agree(spec, cu, tokens, labels, images, real)
