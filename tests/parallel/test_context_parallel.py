"""Context parallelism (`parallel.context`) on real processes on the CPU (gloo), against one process.

Two ranks that split each sample's tokens (Ulysses, ring) train what one process trains on the same samples: the
same losses, gradient norms (rel 1e-4) and trained weights (rtol 1e-4, atol 1e-4), for LoRA and full fine-tuning,
for every family with a plan (LTX-Video, LTX-2 with its audio stream, Wan 2.1 text- and image-to-video, Wan 2.2);
four ranks as 2 data x 2 context train what one process trains with twice the batch, and their checkpoint resumes in
one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers.distributed import rank_main, spawn_ranks
from tests.models.test_ltx_2_audio import CLIP_FRAMES, FPS, write_tone
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.trainers import build_trainer

STEPS = 2
KILL_WORKER = Path(__file__).with_name("fsdp_kill_worker.py")  # `vidtune train` whose rank RANK dies at POSITION
# Trained weights: AdamW's first steps turn a near-zero gradient's rounding into a visible part of its step (with ring,
# up to 2e-5 on one LoRA element of 0.2, the losses and gradient norms equal to 1e-6); the data-parallel tests' atol.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.rglob("*.safetensors"))
    files = [f for f in files if "checkpoint" not in f.parts[-3:-1] and "checkpoints" not in f.parts]
    # Files named after the run (the ComfyUI adapter) are keyed without its name.
    return {f"{str(f.relative_to(folder)).replace(folder.name, '')}:{key}": value
            for f in files for key, value in load_file(f).items()}


def _torchrun(*arguments: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *arguments], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _same_run(trained: Path, expected: Path) -> None:
    got, want = _weights(trained), _weights(expected)
    assert got.keys() == want.keys() and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOLERANCE, msg=key)
    rows, reference = _metrics(trained), _metrics(expected)
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for row, ref in zip(rows, reference, strict=True):
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)

# Every family with a context-parallel plan: LoRA with each way of splitting, full fine-tuning with each.
CASES = [
    ("ltx-video", "lora", {"ulysses": 2}),
    ("ltx-video", "lora", {"ring": 2}),
    ("ltx-video", "full", {"ring": 2}),
    ("wan", "lora", {"ulysses": 2}),
    ("wan", "lora", {"ring": 2}),
    ("wan", "full", {"ulysses": 2}),
    ("wan-i2v", "lora", {"ulysses": 2}),
    ("wan-i2v", "lora", {"ring": 2}),
    ("wan2.2", "lora", {"ulysses": 2}),
    ("wan2.2", "lora", {"ring": 2}),
    ("ltx-2", "lora", {"ulysses": 2}),
    ("ltx-2", "lora", {"ring": 2}),
    ("ltx-2", "full", {"ring": 2}),
]


def _case_name(family: str, algorithm: str, split: dict) -> str:
    return f"{family}-{algorithm}-{'-'.join(split)}"


# Validation samples after step 1 (rank 0 alone, the split taken off and put back) before step 2 trains split again.
SAMPLED = "wan-lora-ring"


def _sound_clips(root: Path) -> Path:
    """Two clips of 17 frames at 24 fps, one with a tone as its sound track, one without: 18 audio latent frames
    and 5 x 8 x 8 video tokens, both divisible by the context degree."""
    folder = root / "sound-clips"
    if not folder.is_dir():
        render_shapes_dataset(folder, num_clips=2, num_frames=CLIP_FRAMES, height=32, width=32, fps=FPS, seed=0)
        write_tone(folder / "clips" / "clip_000.mp4", 1000.0)
    return folder


def _config(make_config, folder: Path, family: str, algorithm: str, **sections):
    training = {"steps": STEPS, "algorithm": algorithm, "learning_rate": 1e-3, **sections.pop("training", {})}
    if family == "ltx-2":  # one step on the clip with sound (joint streams), one on the other (video alone)
        sections["data"] = {"root": str(_sound_clips(folder.parent)), "frames": CLIP_FRAMES}
    if family in ("ltx-video", "ltx-2"):  # every sample given its first frame: per-token timesteps, split too
        sections["model"] = {"first_frame_conditioning": 1.0}
    if folder.name.startswith(SAMPLED):
        sections["validation"] = {"enabled": True, "every": 1, "num_inference_steps": 2}
    return make_config(family, output_dir=str(folder), training=training, logging={"progress": False, "log_every": 1},
                       **sections)


@pytest.mark.slow
def test_two_context_ranks_train_what_one_process_trains(make_config, tmp_path):
    runs = [(_case_name(*case), _config(make_config, tmp_path / _case_name(*case), case[0], case[1],
                                        parallel={"context": case[2]}).to_dict(), {}) for case in CASES]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for family, algorithm, split in CASES:
        name = _case_name(family, algorithm, split)
        for result in ranks:
            assert "error" not in result[name], result[name]
        build_trainer(_config(make_config, tmp_path / f"{name}-single", family, algorithm)).run()
        _same_run(tmp_path / name, tmp_path / f"{name}-single")
        if family == "ltx-2":  # one compared loss holds the audio error of the clip with sound
            assert sorted(row["audio_sigmas"][0] is None for row in _metrics(tmp_path / name)) == [False, True]
        # Both ranks trained on the same samples: the stream gave the group one sample each step.
        assert ranks[0][name]["positions"] == ranks[1][name]["positions"]
    assert sorted(p.name for p in (tmp_path / SAMPLED / "samples").glob("*.mp4")) == [
        "step-00000001-0.mp4", "step-00000002-0.mp4"]


@pytest.mark.slow
def test_two_data_by_two_context_ranks_train_what_one_process_trains_with_twice_the_batch(make_config, tmp_path):
    """World 4 = 2 data groups x 2 context ranks (FSDP over all four, Ulysses in each group), batch 1 per group:
    one process with batch 2; its checkpoint of step 1 resumes in one process and ends where that one does."""
    mesh = _config(make_config, tmp_path / "mesh", "ltx-video", "lora", checkpoint={"every": 1, "keep": 2},
                   parallel={"strategy": "fsdp", "context": {"ulysses": 2}})
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (4, [("mesh", mesh.to_dict(), {})], str(out)), nprocs=4)
    ranks = [json.loads((out / f"rank{r}.json").read_text())["mesh"] for r in range(4)]
    assert all("error" not in result for result in ranks), ranks
    # The ranks of a group read the same samples, the two groups different ones.
    assert ranks[0]["positions"] == ranks[1]["positions"] != ranks[2]["positions"] == ranks[3]["positions"]

    build_trainer(_config(make_config, tmp_path / "single", "ltx-video", "lora", training={"batch_size": 2})).run()
    _same_run(tmp_path / "mesh", tmp_path / "single")

    first = tmp_path / "mesh" / "checkpoints" / "step-00000001"
    assert first.is_dir(), sorted(p.name for p in (tmp_path / "mesh" / "checkpoints").iterdir())
    build_trainer(_config(make_config, tmp_path / "resumed", "ltx-video", "lora", training={"batch_size": 2},
                          checkpoint={"resume": str(first)})).run()
    got, want = _weights(tmp_path / "resumed"), _weights(tmp_path / "single")
    assert got.keys() == want.keys() and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOLERANCE, msg=key)


@pytest.mark.slow
def test_a_killed_context_rank_restarted_by_torchrun_resumes_bit_for_bit(make_config, tmp_path):
    """Two ranks splitting each sample (Ulysses); rank 1 kills itself (SIGKILL) in step 3. torchrun stops rank 0 and
    starts both again, which continue from the checkpoint of step 2: the same adapter and losses, bit for bit, as the
    same run never killed."""
    def write(name: str) -> Path:
        config = _config(make_config, tmp_path / name, "wan", "lora", training={"steps": 4},
                         checkpoint={"every": 2, "keep": 2, "resume": "latest"},
                         parallel={"context": {"ulysses": 2}})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config.to_dict()))
        return path

    whole = _torchrun("--standalone", "--nproc_per_node", "2", "-m", "vidtune", "train", str(write("whole")))
    assert whole.returncode == 0, whole.stderr[-3000:]
    # Batch 1 on one data group: stream position 2 is step 3's micro-batch.
    killed = _torchrun("--standalone", "--nproc_per_node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
                       str(KILL_WORKER), str(write("killed")), "1", "2")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "Resuming from" in killed.stdout and "step-00000002" in killed.stdout
    got, want = _weights(tmp_path / "killed"), _weights(tmp_path / "whole")
    assert got.keys() == want.keys() and want
    assert all(torch.equal(got[key], want[key]) for key in want)
    losses = {name: [row["loss"] for row in _metrics(tmp_path / name)] for name in ("killed", "whole")}
    assert losses["killed"] == losses["whole"] and len(losses["whole"]) == 4
