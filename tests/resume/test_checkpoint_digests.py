"""Checkpoints and exported weights carry digests: a checkpoint with one flipped byte, a file cut short or a file
lost is never resumed or exported: `checkpoint.resume=latest` takes the newest whole one and says which it skipped
and why; a named damaged one is refused with the whole ones beside it; `vidtune checkpoint verify` names them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from vidtune import checkpoint as checkpoints
from vidtune.cli import main
from vidtune.errors import CheckpointError
from vidtune.parallel.dcp import write_shards
from vidtune.resume import find_checkpoint
from vidtune.state import read_checkpoint
from vidtune.storage.digests import TENSORS_DIGEST, file_digest_problem
from vidtune.storage.manifest import MANIFEST
from vidtune.trainers import build_trainer

# The file each format's damage goes to: the trained weights, a DCP shard, one of DeepSpeed's own files.
TARGETS = {"files": checkpoints.WEIGHTS, "sharded": f"{checkpoints.SHARDS}/__0_0.distcp",
           "deepspeed": f"{checkpoints.ZERO_SHARDS}/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"}
SAYS = {"flipped": "does not match its digest", "truncated": "cut short", "missing": "is missing"}


def _write(root: Path, kind: str, step: int, config) -> Path:
    torch.manual_seed(step)
    layer = nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    weights = {f"layer.{name}": value.detach() for name, value in layer.named_parameters()}
    extra = {"samples_consumed": step, "algorithm": "lora", "num_samples": 4}
    if kind == "sharded":
        temporary = checkpoints.begin_sharded(root, step)
        write_shards(temporary / checkpoints.SHARDS, layer, dict(layer.named_parameters()), optimizer)
        return checkpoints.finish_sharded(root, temporary, step=step, extra=extra, config=config, keep=5,
                                          rng={0: checkpoints.rng_state()})
    shards = None
    if kind == "deepspeed":  # DeepSpeed's layout under zero/: its tag's folder, a file per rank
        shards = root / f".zero-{step:08d}"
        (shards / "state").mkdir(parents=True)
        torch.save(optimizer.state_dict(), shards / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        torch.save(weights, shards / "state" / "mp_rank_00_model_states.pt")
    return checkpoints.save(root, step=step, weights=weights, optimizer=optimizer.state_dict(), extra=extra,
                            config=config, keep=5, shards=shards)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(data)
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()


@pytest.mark.parametrize("how", sorted(SAYS))
@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_a_damaged_checkpoint_of_each_format_is_skipped_for_latest_and_refused_by_name(make_config, tmp_path, kind,
                                                                                      how, capsys):
    config = make_config()
    root = tmp_path / "run" / "checkpoints"
    older, newer = (_write(root, kind, step, config) for step in (2, 4))
    assert (newer / MANIFEST).is_file() and checkpoints.verify(newer).intact and checkpoints.verify(older).intact
    if kind == "sharded":
        assert checkpoints.is_sharded(newer)
    _damage(newer / TARGETS[kind], how)

    verdict = checkpoints.verify(newer)
    assert not verdict.intact and TARGETS[kind] in verdict.reason() and SAYS[how] in verdict.reason()
    # The newest whole one, saying which was skipped and why.
    assert find_checkpoint(tmp_path / "run") == older
    printed = capsys.readouterr().out
    assert f"Skipped the checkpoint {newer}: {TARGETS[kind]}" in printed and SAYS[how] in printed
    assert f"Continuing from the newest whole checkpoint, {older}." in printed
    # Named, it is refused, naming the file and the whole checkpoint beside it.
    with pytest.raises(CheckpointError) as refused:
        find_checkpoint(newer)
    assert f"{newer} is not a complete checkpoint: {TARGETS[kind]}" in str(refused.value)
    assert f"name a whole one instead, e.g. {older}" in str(refused.value)


def test_every_file_of_a_checkpoint_is_in_its_manifest_and_a_lost_manifest_is_unverified(make_config, tmp_path,
                                                                                          capsys):
    root = tmp_path / "run" / "checkpoints"
    folder = _write(root, "deepspeed", 2, make_config())
    listed = (folder / MANIFEST).read_text()
    for path in folder.rglob("*"):
        if path.is_file() and path.name != MANIFEST:
            assert f'"{path.relative_to(folder).as_posix()}"' in listed
    (folder / MANIFEST).unlink()  # as a checkpoint of an earlier vidtune: loaded, with a note
    assert find_checkpoint(folder) == folder
    assert "has no digest manifest (it was written by an earlier vidtune)" in capsys.readouterr().out
    (folder / checkpoints.STATE).unlink()  # still: a checkpoint without its state is not one
    with pytest.raises(CheckpointError, match=f"{checkpoints.STATE} is missing"):
        find_checkpoint(folder)


def test_no_whole_checkpoint_left_is_refused_not_started_over(make_config, tmp_path):
    config = make_config(checkpoint={"resume": "latest"})
    root = Path(config.output_dir) / "checkpoints"
    folder = _write(root, "files", 2, config)
    _damage(folder / checkpoints.WEIGHTS, "flipped")
    with pytest.raises(CheckpointError, match=r"no checkpoint under .* is whole; nothing was loaded or changed"):
        build_trainer(config).run()
    assert folder.is_dir() and not (Path(config.output_dir) / "metrics.jsonl").exists()


def test_a_run_resumes_from_the_newest_whole_checkpoint_when_the_newest_has_a_flipped_byte(make_config, tmp_path,
                                                                                         capsys):
    out = tmp_path / "run"
    build_trainer(make_config(training={"steps": 4}, checkpoint={"every": 2}, output_dir=str(out))).run()
    newest = out / "checkpoints" / "step-00000004"
    _damage(newest / checkpoints.WEIGHTS, "flipped")
    capsys.readouterr()
    result = build_trainer(make_config(training={"steps": 6}, checkpoint={"every": 2, "resume": "latest"},
                                       output_dir=str(out))).run()
    printed = capsys.readouterr().out
    assert result.first_step == 2 and result.final_step == 6
    assert f"Skipped the checkpoint {newest}: weights.safetensors does not match its digest" in printed
    assert f"Resuming from {out / 'checkpoints' / 'step-00000002'}" in printed


def test_a_cut_short_state_of_an_unverifiable_checkpoint_names_the_whole_one_to_use(make_config, tmp_path):
    """The message of a checkpoint without a manifest (an earlier vidtune's) that does not load."""
    config = make_config()
    root = tmp_path / "run" / "checkpoints"
    older, newer = (_write(root, "files", step, config) for step in (2, 4))
    (newer / MANIFEST).unlink()
    _damage(newer / checkpoints.STATE, "truncated")
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(find_checkpoint(newer), config, "lora")
    assert f"Could not read the checkpoint {newer}" in str(refused.value)
    assert f"What to do: resume from an earlier whole checkpoint: checkpoint.resume={older}" in str(refused.value)


def test_exported_weights_carry_their_digest_and_verify_names_a_damaged_one(make_config, tmp_path, capsys):
    out = tmp_path / "run"
    build_trainer(make_config(training={"steps": 2}, checkpoint={"every": 1}, output_dir=str(out))).run()
    lora, comfyui = out / "pytorch_lora_weights.safetensors", out / "run_comfyui.safetensors"
    for path in (lora, comfyui):
        assert file_digest_problem(path) is None
        with open(path, "rb") as handle:  # the digest sits in the metadata, beside what diffusers reads
            assert TENSORS_DIGEST.encode() in handle.read(8 + int.from_bytes(handle.read(8), "little"))
    assert load_file(lora)  # still an ordinary safetensors file
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(out)]) == 0
    report = capsys.readouterr().out
    assert "checkpoints/step-00000001" in report and "run_comfyui.safetensors" in report
    assert "All 4 checked are whole." in report

    _damage(comfyui, "flipped")
    _damage(out / "checkpoints" / "step-00000002" / checkpoints.STATE, "truncated")
    assert main(["checkpoint", "verify", str(out)]) == 1
    report = capsys.readouterr().err
    assert "run_comfyui.safetensors" in report and "DAMAGED: its tensor bytes do not match" in report
    assert "DAMAGED: training_state.pt is" in report and "2 of 4 damaged" in report
    assert main(["checkpoint", "verify", str(out / "checkpoints" / "step-00000001")]) == 0
    # `vidtune export` of the damaged checkpoint is refused; the whole one exports.
    assert main(["export", str(out / "checkpoints" / "step-00000002"), "--output", str(tmp_path / "x")]) == 2
    assert "is not a complete checkpoint: training_state.pt" in capsys.readouterr().err
    assert main(["export", str(out / "checkpoints" / "step-00000001"), "--output", str(tmp_path / "y")]) == 0
    assert file_digest_problem(tmp_path / "y" / "pytorch_lora_weights.safetensors") is None


def test_a_full_fine_tune_s_shards_carry_their_digest(make_config, tmp_path):
    out = tmp_path / "full"
    build_trainer(make_config(training={"steps": 1, "algorithm": "full"}, output_dir=str(out))).run()
    shards = sorted((out / "transformer").glob("*.safetensors"))
    assert shards and all(file_digest_problem(path) is None for path in shards)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(shards[0], copy)
    _damage(copy, "truncated")
    assert "not a whole safetensors file" in file_digest_problem(copy)
