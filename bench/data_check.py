"""`vidtune data check` on a few hundred generated clips: seconds per hundred clips, and the decode work of a
probe against a full decode of the same clip, as a ratio.

The clips are real H.264 mp4 files (moving shapes, 2 s at 24 fps, 64x48) in a `pairs` dataset and a `folder`
dataset, with a few stills; the check runs as the CLI runs it (tokenizer loaded, every sample probed, hashed for
duplicates, the contact sheet written). Then, on clips of 2 s and of 10 s, one probe (`probe_video`: demux every
packet, decode until the first picture) is timed against decoding every frame; frames decoded are counted too.

    python bench/data_check.py [--clips 300] [--frames 48] [--sample 20]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import av
import yaml

from vidtune.cli import main
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.data.video import probe_video
from vidtune.models.tiny import write_tiny_model


def full_decode(path: Path) -> int:
    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=300)
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--sample", type=int, default=20, help="clips timed for probe against full decode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        made = time.perf_counter()
        half = args.clips // 2
        pairs = render_shapes_dataset(work / "pairs", num_clips=half, num_frames=args.frames, height=48, width=64)
        shots = render_shapes_dataset(work / "shots", num_clips=args.clips - half, num_frames=args.frames,
                                      height=64, width=48, seed=1)
        captions = (shots / "prompts.txt").read_text().splitlines()
        for number, line in enumerate((shots / "videos.txt").read_text().splitlines()):
            (shots / line).with_suffix(".txt").write_text(captions[number])
        (shots / "videos.txt").unlink()
        (shots / "prompts.txt").unlink()
        print(f"{args.clips} clips written in {time.perf_counter() - made:.1f} s")
        model = write_tiny_model("ltx-video", work / "model")
        config = work / "check.yaml"
        config.write_text(yaml.safe_dump({
            "model": {"name": "ltx-video", "pretrained": str(model)},
            "data": {"datasets": [{"type": "pairs", "root": str(pairs)}, {"type": "folder", "root": str(shots)}],
                     "buckets": [[17, 32, 64], [17, 64, 32], [1, 32, 32]], "fps": 12},
            "output_dir": str(work / "run"), "logging": {"progress": False}}))
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as out:
            code = main(["data", "check", str(config), "--report", str(work / "report.json")])
        seconds = time.perf_counter() - started
        assert code == 0, out.getvalue()[-2000:]
        print(f"vidtune data check: {seconds:.2f} s for {args.clips} clips = "
              f"{100 * seconds / args.clips:.2f} s per hundred clips (contact sheet and JSON report included)")

        long = render_shapes_dataset(work / "long", num_clips=args.sample, num_frames=240, height=48, width=64)
        for name, folder in (("2 s", pairs), ("10 s", long)):
            clips = sorted((folder / "clips").glob("*.mp4"))[: args.sample]
            probes, decodes = [], []
            for path in clips:
                started = time.perf_counter()
                probe_video(path)
                probes.append(time.perf_counter() - started)
                started = time.perf_counter()
                frames = full_decode(path)
                decodes.append(time.perf_counter() - started)
            probe, decode = statistics.median(probes), statistics.median(decodes)
            print(f"{name} clips ({frames} frames, median of {len(clips)}): probe {1000 * probe:.2f} ms (1 frame "
                  f"decoded), full decode {1000 * decode:.2f} ms ({frames} frames); time ratio "
                  f"{probe / decode:.3f}, frames decoded ratio {1 / frames:.3f}")


if __name__ == "__main__":
    main_bench()
