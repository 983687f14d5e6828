"""What reading a window's sound adds to reading its frames (LTX-2 training on a clip's own sound).

Writes one clip (H.264 frames with a 48 kHz stereo AAC track), then times, rounds alternating, the frames of a window
as training decodes them (`decode_clip`) against the window's sound (`decode_audio`, resampled to 16 kHz stereo) and
the sound plus its log-mel spectrogram (LTX-2's settings), and prints the medians and their ratio to the frames.

    OMP_NUM_THREADS=1 python bench/audio_decode.py --frames 121 --height 512 --width 768 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from vidtune.data.audio import AudioFormat, decode_audio, log_mel_spectrogram
from vidtune.data.video import ClipWindow, decode_clip, write_video


def write_clip(path: Path, frames: int, height: int, width: int, fps: float, seconds_before: float) -> Path:
    """A clip of moving noise (so H.264 has work to do) and a chord, `seconds_before` longer than the window."""
    rng = np.random.default_rng(0)
    total = frames + round(seconds_before * fps)
    base = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    video = np.stack([np.kron(np.roll(base, i, axis=1), np.ones((8, 8, 1), np.uint8)) for i in range(total)])
    rate = 48000
    t = np.arange(round(total / fps * rate)) / rate
    chord = sum(0.2 * np.sin(2 * np.pi * hz * t) for hz in (220.0, 277.2, 329.6)).astype(np.float32)
    return write_video(path, video, fps, audio=np.stack([chord, 0.8 * chord]), sample_rate=rate)


def timed(work: Callable[[], object], rounds: list[float]) -> None:
    started = time.perf_counter()
    work()
    rounds.append((time.perf_counter() - started) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--fps", type=float, default=24.0)
    parser.add_argument("--start-seconds", type=float, default=2.0, help="the window's start (a seek)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    audio = AudioFormat(16000, 2, args.fps)
    start = round(args.start_seconds * args.fps)
    with tempfile.TemporaryDirectory() as folder:
        clip = write_clip(Path(folder) / "clip.mp4", args.frames, args.height, args.width, args.fps,
                          args.start_seconds)
        times: dict[str, list[float]] = {"frames": [], "sound": [], "sound + log-mel": []}

        def sound_and_mel() -> torch.Tensor:
            waveform = torch.from_numpy(decode_audio(clip, args.frames, start, audio))[None]
            return log_mel_spectrogram(waveform, 16000, 1024, 160, 64)

        work = {
            "frames": lambda: decode_clip(clip, ClipWindow(args.frames, args.height, args.width, start=start)),
            "sound": lambda: decode_audio(clip, args.frames, start, audio),
            "sound + log-mel": sound_and_mel,
        }
        for name in work:  # warm-up: file cache, codec initialisation
            work[name]()
        for _ in range(args.rounds):
            for name, job in work.items():
                timed(job, times[name])
    frames_ms = statistics.median(times["frames"])
    print(f"window: {args.frames} frames of {args.height}x{args.width} at {args.fps:g} fps from "
          f"{args.start_seconds:g} s; sound 48 kHz stereo AAC -> 16 kHz stereo; {args.rounds} rounds")
    print("| read | median ms | ratio to frames |")
    print("|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / frames_ms:.3f} |")


if __name__ == "__main__":
    main()
