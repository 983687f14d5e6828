"""`vidtune quickstart`: a complete run with no download and no GPU.

It writes a tiny random LTX-Video model, renders a handful of real mp4 clips with captions, writes a
config next to them, and trains through the normal `vidtune train` path. Everything it makes is in
one folder, so the user can open the config, change it and run `vidtune train` on it themselves.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from vidtune.config import load_config
from vidtune.cpu import configure_cpu_threads
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.errors import VidtuneError
from vidtune.models.tiny import write_tiny_model
from vidtune.trainers import TrainResult, build_trainer

QUICKSTART_SETTINGS = {
    "data": {"frames": 17, "height": 64, "width": 64, "fps": 24, "num_workers": 0},
    "training": {
        "steps": 300,
        "batch_size": 2,
        "learning_rate": 2e-3,
        "seed": 0,
        "precision": "fp32",
        "device": "cpu",
    },
    "optimizer": {"lr_scheduler": "cosine", "warmup_steps": 10},
    "lora": {"rank": 16, "alpha": 16},
    "checkpoint": {"every": 100, "keep": 2},
    "validation": {"num_inference_steps": 20, "guidance_scale": 1.0},
}


def quickstart_run_folder(folder: Path) -> Path:
    """Where this quickstart's run goes: `folder/run`, or the first free `run-2`, `run-3`, ... when an earlier
    quickstart's run is there (it is kept)."""
    run, number = folder / "run", 2
    while run.exists():
        run, number = folder / f"run-{number}", number + 1
    return run


def prepare_quickstart(folder: Path, num_clips: int = 4, run: Path | None = None) -> Path:
    """Write model, clips and config (training into `run`, default `folder/run`) under `folder`; return the
    config path."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way, no permission
        raise VidtuneError(f"--output: cannot create the folder {folder} ({error.strerror or error}); choose "
                           "another --output") from None
    from transformers.utils import logging as transformers_logging

    # Saving the tiny text encoder draws a progress bar of one shard: noise in the quickstart's output.
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        model_dir = write_tiny_model("ltx-video", folder / "tiny-ltx-video")
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    data = QUICKSTART_SETTINGS["data"]
    data_dir = render_shapes_dataset(
        folder / "data", num_clips=num_clips, num_frames=data["frames"] + 8, height=96, width=96,
        fps=data["fps"], seed=0,
    )
    config = {
        "model": {"name": "ltx-video", "pretrained": str(model_dir.resolve())},
        "data": {"root": str(data_dir.resolve()), **data},
        **{key: value for key, value in QUICKSTART_SETTINGS.items() if key != "data"},
        "output_dir": str((run or folder / "run").resolve()),
    }
    path = folder / "quickstart.yaml"
    header = f"# Run with: vidtune train {path}\n# The tiny model and clips were written by vidtune quickstart.\n"
    path.write_text(header + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def run_quickstart(folder: Path, overrides: list[str] | None = None) -> TrainResult:
    """Train the quickstart in `folder`; an earlier quickstart's run there is kept, and this one goes beside it."""
    folder = Path(folder)
    run = quickstart_run_folder(folder)
    if run.name != "run":
        print(f"An earlier quickstart run is in {folder / 'run'} (kept); this one trains in {run}.", flush=True)
    config_path = prepare_quickstart(folder, run=run)
    config = load_config(config_path, overrides)
    configure_cpu_threads(config)
    return build_trainer(config).run()
