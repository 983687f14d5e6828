"""Storage faults: a full disk at any writer of a run ends in one plain message (the folder, how much is needed,
that nothing earlier was lost, the exact command that continues), exit 2, no partial file under a final name, and
the run resumes once there is space; the space a run needs is known before its first checkpoint; a read-only output
folder, a vanished cache folder and a clip that may not be read are named before any work."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers.storage import full_disk_at, leftovers
from vidtune import checkpoint as checkpoints
from vidtune.captioning.qwen_inputs import VisionSettings
from vidtune.cli import main
from vidtune.errors import StorageError
from vidtune.files import append_line
from vidtune.models.tiny import TINY_SHAPES
from vidtune.storage import space as space_module
from vidtune.storage.space import CheckpointSpace, check_space, folder_size
from vidtune.trainers import build_trainer
from vidtune.training.setup import checkpoint_space


def _config_file(tmp_path: Path, tiny: Path, root: Path, **sections) -> Path:
    frames, height, width = TINY_SHAPES["ltx-video"]
    config = {
        "model": {"name": "ltx-video", "pretrained": str(tiny)},
        "data": {"root": str(root), "frames": frames, "height": height, "width": width, "num_workers": 0},
        "training": {"steps": 2, "device": "cpu", "precision": "fp32"},
        "checkpoint": {"every": 1},
        "validation": {"enabled": True, "num_inference_steps": 2},
        "logging": {"progress": False},
        "output_dir": str(tmp_path / "run"),
        **sections,
    }
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# (the file whose write finds the disk full, how many writes of it succeed first, whether a checkpoint is there)
WRITERS = [
    ("config.yaml", 0, False),  # the run's resolved config, before anything else
    ("dataset_overview.png", 0, False),
    ("manifest.json", 1, True),  # the second checkpoint's last file
    ("loss.png", 0, True),
    ("metrics.jsonl", 1, True),
    ("step-00000002-0.mp4", 0, True),  # the final validation's sample
    ("samples_by_step.png", 0, True),
    ("pytorch_lora_weights.safetensors", 0, True),
    ("run_comfyui.safetensors", 0, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "after", "checkpointed"), WRITERS, ids=[row[0] for row in WRITERS])
def test_a_full_disk_at_each_writer_ends_in_one_message_and_the_run_resumes(tmp_path, tiny_model_dir, shapes_dataset,
                                                                           monkeypatch, capsys, name, after,
                                                                           checkpointed):
    config = _config_file(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset)
    run = tmp_path / "run"
    before = {}
    disk = full_disk_at(monkeypatch, name, after)
    if name == "metrics.jsonl":  # what the first row was, to see that the refused one left no half row
        original = append_line

        def remembering(path, line):
            original(path, line)
            before["metrics"] = path.read_bytes()

        monkeypatch.setattr("vidtune.metrics.append_line", remembering)
    code = main(["train", str(config)])
    monkeypatch.undo()
    error = capsys.readouterr().err
    assert disk.failed and code == 2, error
    assert "Traceback" not in error
    assert f"Could not write {name if name != 'manifest.json' else 'the checkpoint of step 2'}" in error
    assert "the disk is full" in error
    if checkpointed:
        newest = checkpoints.latest(run / "checkpoints")
        assert f"Nothing written earlier was lost: the newest checkpoint, {newest}, is whole." in error
        assert checkpoints.verify(newest).intact
        assert "This run needs about" in error and "free at least" in error  # how much, in numbers
    else:
        assert "Nothing written earlier was lost (no checkpoint was written yet)." in error
    assert not leftovers(run), leftovers(run)
    if "metrics" in before:
        assert (run / "metrics.jsonl").read_bytes() == before["metrics"]
    # The last line is the command that continues the run, as given.
    again = error.strip().splitlines()[-1].strip()
    assert again == f"vidtune train {config} checkpoint.resume=latest"
    assert main(shlex.split(again)[1:]) == 0
    assert (run / "pytorch_lora_weights.safetensors").is_file() and (run / "samples" / "step-00000002-0.mp4").is_file()
    assert main(["checkpoint", "verify", str(run)]) == 0


def test_a_row_the_disk_refuses_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    log = tmp_path / "metrics.jsonl"
    append_line(log, '{"step": 1}')
    real = os.write

    def half_then_full(handle, data):  # the disk fills half-way through the row
        real(handle, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(StorageError, match=f"Could not write metrics.jsonl in {tmp_path}: the disk is full"):
        append_line(log, '{"step": 2, "loss": 0.5}')
    monkeypatch.undo()
    assert log.read_text() == '{"step": 1}\n'


def _free(monkeypatch, free: int) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(space_module.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=free))


def test_the_space_a_run_needs_is_said_before_its_first_step(tmp_path, monkeypatch):
    space = CheckpointSpace(checkpoint=300 << 20, final=100 << 20, keep=2)
    # A fresh run writing 5 checkpoints: 3 on disk at once (2 kept and the newest being written), then the final files.
    assert space.needed(existing=0, to_write=5) == 3 * (300 << 20) + (100 << 20)
    assert space.needed(existing=2, to_write=5) == (300 << 20) + (100 << 20)  # resumed: the kept ones are there
    _free(monkeypatch, 2 << 30)
    assert check_space(tmp_path, space, 0, 5) is None
    _free(monkeypatch, 500 << 20)
    warning = check_space(tmp_path, space, 0, 5)
    assert warning.startswith(f"output_dir {tmp_path}: its disk has 500.0 MiB free, and this run needs about 1000.0 "
                              "MiB more: 3 more checkpoints of 300.0 MiB (estimated")
    assert "lower checkpoint.keep" in warning
    _free(monkeypatch, 200 << 20)
    with pytest.raises(StorageError, match=r"less than one checkpoint of this run .300.0 MiB.*Nothing was trained"):
        check_space(tmp_path, space, 0, 5)


def test_a_run_knows_its_checkpoints_size_before_the_first_and_refuses_a_disk_too_small(make_config, tmp_path,
                                                                                      monkeypatch, capsys):
    trainer = build_trainer(make_config(training={"steps": 2}, checkpoint={"every": 1}))
    trainer.run()
    context = trainer.context
    estimate = checkpoint_space(context.config, context.spec, context.part, context.parameters)
    measured = context.state.space
    newest = checkpoints.latest(context.checkpoints_root)
    assert measured.measured and measured.checkpoint == folder_size(checkpoints.list_checkpoints(
        context.checkpoints_root)[0])
    assert 0.7 < estimate.checkpoint / measured.checkpoint < 1.5, (estimate, measured)
    assert newest is not None
    # A disk that cannot hold one checkpoint: refused before the first step, nothing trained.
    _free(monkeypatch, 64 << 10)
    out = tmp_path / "small-disk"
    with pytest.raises(StorageError, match="less than one checkpoint of this run"):
        build_trainer(make_config(training={"steps": 2}, output_dir=str(out))).run()
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    # One that holds a checkpoint but not the whole run: a warning with the numbers, and the run goes on.
    _free(monkeypatch, int(measured.checkpoint * 1.5))
    capsys.readouterr()
    result = build_trainer(make_config(training={"steps": 2}, output_dir=str(tmp_path / "tight"))).run()
    assert result.final_step == 2
    assert "Warning: output_dir" in capsys.readouterr().out


def test_a_read_only_output_folder_is_named_before_anything_loads(tmp_path, tiny_model_dir, shapes_dataset,
                                                                  monkeypatch, capsys):
    config = _config_file(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset)
    (tmp_path / "run").mkdir()  # a folder on a drive mounted read-only
    real = Path.write_bytes

    def read_only(self, data):
        if self.name.startswith(".vidtune-write-test"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    assert main(["train", str(config)]) == 2
    error = capsys.readouterr().err
    assert f"Could not write a test file (output_dir) in {tmp_path / 'run'}: the file system is read-only" in error
    assert "Nothing was started." in error and "choose a folder on a writable disk" in error
    assert list((tmp_path / "run").iterdir()) == []
    # Not there yet, in a folder that may not be written: said as such, and nothing is made.
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    assert main(["train", str(config), f"output_dir={tmp_path / 'new-run'}"]) == 2
    error = capsys.readouterr().err
    assert f"in {tmp_path / 'new-run'}: permission denied" in error and "Nothing was started." in error
    assert not (tmp_path / "new-run").exists()


def test_a_cache_folder_that_vanished_is_named_not_rebuilt(make_config, tmp_path):
    cache = tmp_path / "usb-drive" / "cache"
    settings = {"precompute": {"enabled": True, "cache_dir": str(cache)}, "data": {"encoded_store_mib": 0},
                "checkpoint": {"every": 1}}
    out = str(tmp_path / "run")
    build_trainer(make_config(training={"steps": 2}, output_dir=out, **settings)).run()
    # Unmounted between two runs: the resumed run is refused before it computes anything.
    shutil.rmtree(tmp_path / "usb-drive")
    resumed = make_config(training={"steps": 3}, output_dir=out, checkpoint={"every": 1, "resume": "latest"},
                          **{key: value for key, value in settings.items() if key != "checkpoint"})
    with pytest.raises(StorageError, match=f"the cache folder {cache} is gone .* Nothing was computed") as refused:
        build_trainer(resumed).run()
    assert f"mkdir -p {cache}" in str(refused.value) and not cache.exists()
    # Unmounted during a run: the run stops at the first read, naming it, its checkpoints whole.
    trainer = build_trainer(make_config(training={"steps": 4}, output_dir=str(tmp_path / "second"), **settings))
    original, calls = trainer.loss, [0]

    def unmounting(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            shutil.rmtree(cache)
        return original(*args, **kwargs)

    trainer.loss = unmounting
    with pytest.raises(StorageError, match=f"the cache folder {cache} is gone .* while the run reads from it") as gone:
        trainer.run()
    assert "the newest checkpoint, " in str(gone.value) and "mount the drive again" in str(gone.value)


def test_a_clip_that_may_not_be_read_is_named_with_its_line(tmp_path, tiny_model_dir, shapes_dataset, monkeypatch,
                                                           capsys):
    config = _config_file(tmp_path, tiny_model_dir("ltx-video"), shapes_dataset)
    denied = shapes_dataset / (shapes_dataset / "videos.txt").read_text().splitlines()[1]
    real = Path.open

    def no_permission(self, *args, **kwargs):
        if self == denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", no_permission)
    assert main(["data", "check", str(config)]) == 1
    error = capsys.readouterr().err
    line = next(text for text in error.splitlines() if str(denied) in text)
    assert "videos.txt line 2" in line and "permission denied: you may not read this file" in line


class _Describing:
    settings = VisionSettings()

    def caption(self, batch, instructions):
        return ["a clip" for _ in batch]


def test_a_full_disk_while_captioning_keeps_every_caption_made_and_a_rerun_does_the_rest(tmp_path, monkeypatch,
                                                                                       capsys, shapes_dataset):
    data = tmp_path / "clips"
    data.mkdir()
    for index, name in enumerate((shapes_dataset / "videos.txt").read_text().splitlines()[:3]):
        shutil.copy(shapes_dataset / name, data / f"take{index}.mp4")
    monkeypatch.setattr("vidtune.captioning.run.load_captioner", lambda settings: _Describing())
    disk = full_disk_at(monkeypatch, "take1.txt")
    assert main(["caption", str(data), "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert disk.failed and f"Could not write take1.txt in {data}: the disk is full" in error
    assert "Every caption made before it is written" in error and "run the same command again" in error
    assert (data / "take0.txt").read_text() == "a clip\n" and not (data / "take1.txt").exists()
    assert not leftovers(data)
    monkeypatch.undo()  # space again
    monkeypatch.setattr("vidtune.captioning.run.load_captioner", lambda settings: _Describing())
    assert main(["caption", str(data), "--device", "cpu"]) == 0
    assert all((data / f"take{index}.txt").read_text() == "a clip\n" for index in range(3))
