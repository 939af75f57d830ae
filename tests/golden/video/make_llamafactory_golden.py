"""Golden data for the ``llamafactory`` video profile (tests/families/test_video_llamafactory.py), made by
running LLaMA-Factory 0.9.5's own ``llamafactory/data/mm_plugin.py`` (see tests/golden/README.md):

    pip install --no-deps --target /SCRATCH/lf llamafactory==0.9.5
    python tests/golden/video/make_llamafactory_golden.py /SCRATCH/lf tests/golden/video/llamafactory_0.9.5.json.gz

in this project's venv (transformers, torch, PyAV). ``mm_plugin`` is loaded alone, without the package's
``__init__`` (which needs peft, datasets' loaders, ...); the two modules it imports and never calls for
video (torchaudio, peft.utils' file names) are stood in by empty modules in a temporary directory.
"""

import gzip
import importlib.util
import json
import re
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
STUBS = Path(tempfile.mkdtemp())
(STUBS / "torchaudio").mkdir()
(STUBS / "torchaudio" / "__init__.py").write_text("")
(STUBS / "peft").mkdir()
(STUBS / "peft" / "__init__.py").write_text("")
(STUBS / "peft" / "utils.py").write_text('SAFETENSORS_WEIGHTS_NAME = "adapter_model.safetensors"\nWEIGHTS_NAME = "adapter_model.bin"\n')
sys.path[:0] = [str(STUBS), str(ROOT)]
LF = str(Path(sys.argv[1]) / "llamafactory")
for name, path in [("llamafactory", LF), ("llamafactory.data", LF + "/data"), ("llamafactory.extras", LF + "/extras")]:
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
spec = importlib.util.spec_from_file_location("llamafactory.data.mm_plugin", LF + "/data/mm_plugin.py")
m = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = m
spec.loader.exec_module(m)
import av
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from neva_pack.families import resolve_encoder

Q25, Q3 = "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"

def processor(name):
    config = dict(resolve_encoder(name).preprocessor_config)
    settings = {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class", "size", "min_pixels", "max_pixels")}
    if name == Q3:
        video = Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824}, **settings)
        image = Qwen2VLImageProcessor(**settings)
        names = ["input_ids", "pixel_values_videos", "video_grid_thw"]
    else:
        video = Qwen2VLVideoProcessor(min_pixels=config["min_pixels"], max_pixels=config["max_pixels"], **settings)
        image = Qwen2VLImageProcessor(min_pixels=config["min_pixels"], max_pixels=config["max_pixels"], **settings)
        names = ["input_ids", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"]
    print(name, video.size, file=sys.stderr)
    return SimpleNamespace(image_processor=image, video_processor=video, model_input_names=names,
                           _calculate_timestamps=lambda i, f, s=2: Qwen3VLProcessor._calculate_timestamps(None, i, f, s))

PLUGIN = {Q25: m.get_mm_plugin("qwen2_vl", image_token="<|image_pad|>", video_token="<|video_pad|>"),
          Q3: m.get_mm_plugin("qwen3_vl", image_token="<|image_pad|>", video_token="<|video_pad|>")}
PROC = {Q25: processor(Q25), Q3: processor(Q3)}

class FakeContainer:
    def __init__(self, stream): self.streams = [stream]
    def close(self): pass

def layout(name, video, stream=None):
    """What LLaMA-Factory 0.9.5 makes of one clip in a one-message conversation: the indices it samples,
    video_grid_thw, second_per_grid_ts (from its frame path, Qwen2.5-VL) and the expanded message text."""
    plugin, proc = PLUGIN[name], PROC[name]
    real_open = m.av.open
    if stream is not None:
        m.av.open = lambda *a, **k: FakeContainer(stream)
    try:
        meta = plugin._get_qwen_video_stream_metadata(video, 2.0, 128)
        grid = plugin._get_qwen_video_grid_metadata([video], proc)
        content = plugin.process_messages([{"role": "user", "content": "<video>"}], [], [video], [], proc)[0]["content"]
    finally:
        m.av.open = real_open
    out = {"indices": [int(i) for i in meta["sample_indices"]], "video_grid_thw": grid["video_grid_thw"][0].tolist()}
    if name == Q25:
        n = len(meta["sample_indices"])
        out["second_per_grid_ts"] = 2 / (n / float(stream.duration * stream.time_base)) if stream is not None else None
        assert content.startswith("<|vision_start|>") and content.endswith("<|vision_end|>")
    else:
        out["timestamps"] = re.findall(r"<([0-9.]+) seconds>", content)
    pads = content.count("<|video_pad|>")
    t = out["video_grid_thw"][0]
    if name == Q25:
        assert content == "<|vision_start|>" + "<|video_pad|>" * pads + "<|vision_end|>"
    else:  # no wrap around the clip: each temporal patch its timestamp then its frame run
        run = "<|vision_start|>" + "<|video_pad|>" * (pads // t) + "<|vision_end|>"
        assert content == "".join(f"<{ts} seconds>" + run for ts in out["timestamps"]) and len(out["timestamps"]) == t
    out["pads"] = pads
    return out

def grid():
    cases, sampling = [], {}
    frames_ = (1, 2, 3, 4, 5, 9, 31, 60, 301, 5000)
    fps_ = (2.5, 10.0, 30000 / 1001, 60.0)
    sizes = ((17, 33), (240, 320), (720, 1280), (2160, 3840), (20, 4000))
    for frames in frames_:
        for fps in fps_:
            for stretch in (1.0, 0.73):
                duration = frames / fps * stretch
                for height, width in sizes:
                    stream = SimpleNamespace(type="video", frames=frames, duration=duration, time_base=1, average_rate=fps,
                                             width=width, height=height)
                    for name in (Q25, Q3):
                        case = {"model": name, "frames": frames, "fps": fps, "duration_s": duration, "width": width, "height": height}
                        out = layout(name, "clip.mp4", stream)
                        key = (frames, fps, duration)
                        entry = sampling.setdefault(key, {"frames": frames, "fps": fps, "duration_s": duration})
                        for field in ("indices", "second_per_grid_ts", "timestamps"):
                            if field in out:
                                value = out.pop(field)
                                assert entry.setdefault(field, value) == value
                        case.update(out)
                        cases.append(case)
    return cases, list(sampling.values())

def clips():
    import tempfile

    from tests.video_zoo import make_random_clips
    out = []
    with tempfile.TemporaryDirectory() as folder:
        for file, path in make_random_clips(folder).items():
            with av.open(str(path)) as c:
                s = c.streams.video[0]
                header = {"frames": s.frames, "duration_s": float(s.duration * s.time_base), "fps": float(s.average_rate),
                          "width": s.width, "height": s.height}
            for name in (Q25, Q3):
                case = {"model": name, "clip": file, **header, **layout(name, str(path))}
                if name == Q25:
                    case["second_per_grid_ts"] = 2 / (len(case["indices"]) / header["duration_s"])
                    # the frame path too: the frames it decodes and the processor's grid and seconds
                    mm = PLUGIN[name]._get_mm_inputs([], [str(path)], [], PROC[name])
                    case["decoded_grid_thw"] = mm["video_grid_thw"][0].tolist()
                    case["decoded_second_per_grid_ts"] = float(mm["second_per_grid_ts"][0])
                else:
                    mm = PLUGIN[name]._get_mm_inputs([], [str(path)], [], PROC[name])
                    case["decoded_grid_thw"] = mm["video_grid_thw"][0].tolist()
                out.append(case)
    return out

if __name__ == "__main__":
    golden = {"reference": "LLaMA-Factory 0.9.5", "settings": {"video_fps": 2.0, "video_maxlen": 128,
              "video_max_pixels": 65536, "video_min_pixels": 256}, "clips": clips()}
    golden["grid"], golden["sampling"] = grid()
    with gzip.GzipFile(sys.argv[2], "wb", compresslevel=9, mtime=0) as out:
        out.write(json.dumps(golden, separators=(",", ":")).encode())
    print(len(golden["grid"]), len(golden["sampling"]), len(golden["clips"]), file=sys.stderr)
