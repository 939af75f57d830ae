"""A DataLoader worker reads its own messages by the record index (offsets of the counting pass):
the same batches as when it delimits the whole file, for any number of workers, start and end."""

import pickle
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_DATA
from tests.pipeline.test_throughput import record_indices


class FakeWorker:
    def __init__(self, id: int, num_workers: int):
        self.id, self.num_workers = id, num_workers


@pytest.fixture(scope="module")
def builder(sample_tokenizer_path):
    from neva_pack.config import PreprocessConfig
    from neva_pack.pipeline import build_sample_builder

    config = PreprocessConfig(data_path=SAMPLE_DATA / "llava_sample.json", image_folder=SAMPLE_DATA / "images",
                              tokenizer_path=sample_tokenizer_path, output_dir=Path("unused"),
                              hf_vision_encoder="openai/clip-vit-base-patch32")  # fmt: skip
    return build_sample_builder(config)


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
@pytest.mark.parametrize(("start", "end", "every"), [(0, None, 1), (2, 19, 3), (5, 20, 4), (13, 17, 32)])
def test_each_worker_reads_the_same_batches_by_offsets(builder, monkeypatch, workers, start, end, every):
    from neva_pack.samples import stream as sample_stream
    from neva_pack.records import index_records

    index = index_records(SAMPLE_DATA / "llava_sample.json", every=every)
    assert index.offsets is not None
    read = {}
    for worker in range(workers):
        monkeypatch.setattr(sample_stream, "get_worker_info", lambda: FakeWorker(worker, workers))
        for name, given in (("offsets", index), ("scan", None)):
            stream = sample_stream.SampleStream(SAMPLE_DATA / "llava_sample.json", builder, start=start, end=end,
                                                       batch_size=3, first_batch_size=2, index=given)  # fmt: skip
            read[name, worker] = [pickle.dumps(batch) for batch in stream]
        assert read["offsets", worker] == read["scan", worker]
    messages = [pickle.loads(batch) for worker in range(workers) for batch in read["offsets", worker]]
    indices = sorted(index for batch in messages for index in record_indices(batch))
    assert indices == list(range(start, 20 if end is None else end))  # every record, once
