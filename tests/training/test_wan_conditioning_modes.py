"""Conditioning modes of the Wan families in whole runs (wan-i2v; Wan 2.2 I2V-A14B with first-last too;
skyreels-v2-df's extension): the same losses from the cache and on the fly, step 0 the base model's loss, a stopped
run resumed bit for bit, validation and `vidtune sample` sampling in the mode through the family's pipeline, and
(slow) an overfit of two clips with one caption where each mode's sample brings back the clip it is given."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.datasets import captioned_dataset, pair_samples
from tests.helpers.runs import run_stopped_at
from vidtune.data.video import ClipWindow, read_clip
from vidtune.given_frames import from_clip
from vidtune.models import conditioning
from vidtune.models.tiny.wan22 import write_tiny_wan22
from vidtune.models.wan import WanImageToVideoSpec
from vidtune.sampling import load_pipeline, sample_run
from vidtune.trainers import build_trainer

LORA_FILE = "pytorch_lora_weights.safetensors"
CAPTION = "a shape moving"
CPU = torch.device("cpu")
# Each model's modes: every one drawn in a run of a few steps (a sample drawing none is plain image-to-video).
# `wan2.2-i2v` is an I2V-A14B, `wan2.2-ti2v` the tiny wan2.2-i2v (a TI2V-5B, whose modes keep the right half).
MODES = {"wan-i2v": {"extension": 0.4, "inpaint": 0.4, "extension_frames": 5},
         "wan2.2-i2v": {"extension": 0.3, "first_last": 0.3, "inpaint": 0.3, "extension_frames": 5},
         "wan2.2-ti2v": {"extension": 0.4, "inpaint": 0.4, "extension_frames": 5, "mask_rectangle": [0, 0, 0.5, 1]},
         "skyreels-v2-df": {"extension": 0.6, "extension_frames": 5}}


@pytest.fixture(scope="module")
def a14b_dir(tmp_path_factory):
    return write_tiny_wan22(tmp_path_factory.mktemp("a14b-i2v") / "model", image_to_video=True, two_experts=True,
                            boundary_ratio=0.5)


def modes_config(make_config, a14b_dir, tmp_path, model_id: str, name: str, **sections):
    model = {"conditioning": MODES[model_id], **sections.pop("model", {})}
    family = "wan2.2-i2v" if model_id == "wan2.2-ti2v" else model_id
    if model_id == "wan2.2-i2v":
        model["pretrained"] = str(a14b_dir)
        sections["data"] = {"frames": 9, "height": 32, "width": 32, **sections.get("data", {})}
    training = {"steps": 3, "batch_size": 2, "seed": 0, **sections.pop("training", {})}
    return make_config(family, model=model, training=training, output_dir=str(tmp_path / name), **sections)


def drawn_modes(trainer) -> list[float]:
    seen: list[float] = []
    original = trainer.spec.visit_conditions

    def visit(x0, positions, seed):
        drawn = original(x0, positions, seed)
        seen.extend(drawn[conditioning.MODE].tolist())
        return drawn

    trainer.spec.visit_conditions = visit
    return seen


# TI2V's modes read nothing from the cache beyond its plain image-to-video (the clip's and the image's latents).
@pytest.mark.parametrize("model_id", ["wan-i2v", "wan2.2-i2v", "skyreels-v2-df"])
def test_the_same_losses_from_the_cache_and_on_the_fly(make_config, a14b_dir, tmp_path, model_id):
    losses, modes = [], []
    for enabled in (False, True):
        trainer = build_trainer(modes_config(make_config, a14b_dir, tmp_path, model_id, f"run-{enabled}",
                                             training={"steps": 3, "batch_size": 1},
                                             precompute={"enabled": enabled, "batch_size": 1,
                                                         "cache_dir": str(tmp_path / "cache")}))
        modes.append(drawn_modes(trainer))
        losses.append(trainer.run().losses)
    assert losses[0] == losses[1]
    assert modes[0] == modes[1] and len(set(modes[0])) >= 2, modes[0]


@pytest.mark.parametrize("model_id", list(MODES))
def test_step_0_is_the_base_models_loss(make_config, a14b_dir, tmp_path, model_id):
    """The adapter starts as the base model: under the same drawn modes (two clips a batch, mixed modes), the first
    batch's loss with it equals the base model's exactly."""
    losses = []
    for algorithm in ("lora", "full"):
        trainer = build_trainer(modes_config(make_config, a14b_dir, tmp_path, model_id, algorithm,
                                             training={"algorithm": algorithm}))
        trainer.set_up()
        batch = next(trainer.context.source.batches(0))
        with torch.no_grad():
            losses.append(trainer.context.loss(trainer.context, batch).total)
    assert torch.equal(losses[0], losses[1])


def test_a_stopped_run_resumes_bit_for_bit(make_config, a14b_dir, tmp_path):
    settings = {"training": {"steps": 4, "batch_size": 1}, "checkpoint": {"every": 2}}
    reference = build_trainer(modes_config(make_config, a14b_dir, tmp_path, "wan-i2v", "reference", **settings)).run()
    run_stopped_at(build_trainer(modes_config(make_config, a14b_dir, tmp_path, "wan-i2v", "stopped", **settings)), 3)
    resumed = build_trainer(modes_config(make_config, a14b_dir, tmp_path, "wan-i2v", "stopped",
                                         training={"steps": 4, "batch_size": 1},
                                         checkpoint={"every": 2, "resume": "latest"})).run()
    assert resumed.final_step == 4
    ours, theirs = load_file(tmp_path / "stopped" / LORA_FILE), load_file(tmp_path / "reference" / LORA_FILE)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert resumed.losses[-1] == reference.losses[-1]


def test_validation_and_sample_use_the_mode(make_config, a14b_dir, tmp_path, shapes_dataset):
    """Validation samples in the mode with the largest share (extension: the first clip's first 5 frames as the
    pipeline's given video); `vidtune sample --inpaint` inpaints with the configured rectangle."""
    config = modes_config(make_config, a14b_dir, tmp_path, "wan-i2v", "run", training={"steps": 1, "batch_size": 1},
                          model={"conditioning": {"extension": 0.5, "inpaint": 0.2, "extension_frames": 5}},
                          validation={"enabled": True, "every": 1, "num_inference_steps": 2})
    calls: list[dict] = []
    original = WanImageToVideoSpec.given_inputs

    def recorded(self, given, frames, height, width):
        inputs = original(self, given, frames, height, width)
        calls.append({"mode": given.mode, **inputs})
        return inputs

    WanImageToVideoSpec.given_inputs = recorded
    try:
        result = build_trainer(config).run()
        assert result.sample_paths and [call["mode"] for call in calls] == ["extension"]
        assert calls[0]["given_video"].shape[0] == 5 and float(calls[0]["given_region"][:, :, :2].min()) == 1
        run = load_pipeline(config.output_dir, device="cpu")
        clip = pair_samples(shapes_dataset)[0].video
        written = sample_run(run, "a red circle", tmp_path / "inpaint.mp4", num_inference_steps=2, inpaint=clip)
        assert written.is_file() and calls[-1]["mode"] == "inpaint"
        region = calls[-1]["given_region"]
        assert 0 < float(region.sum()) < region.numel() and float(region[..., 1:3, 1:3].max()) == 0
    finally:
        WanImageToVideoSpec.given_inputs = original


def learnt_error(sampled: torch.Tensor, x0: torch.Tensor, learnt: torch.Tensor) -> float:
    learnt = learnt.expand_as(x0)
    return float(((sampled - x0) * learnt).norm() / (x0 * learnt).norm())


@pytest.mark.slow
def test_each_mode_brings_back_the_clip_it_is_given(make_config, a14b_dir, shapes_dataset, tmp_path):
    """Two clips with one caption, a full fine-tune of wan-i2v drawing extension and inpainting: sampled through
    WanImageToVideoPipeline from each clip's first frames (or kept region), what the sample generates is nearer that
    clip than the other, and well below the untrained model's error."""
    root = captioned_dataset(shapes_dataset, tmp_path / "data", [CAPTION, CAPTION])
    steps = 1000
    config = modes_config(make_config, a14b_dir, tmp_path, "wan-i2v", "overfit", data_root=root,
                          model={"conditioning": {"extension": 0.5, "inpaint": 0.5, "extension_frames": 5}},
                          precompute={"enabled": True, "cache_dir": str(tmp_path / "cache")},
                          training={"algorithm": "full", "steps": steps, "learning_rate": 3e-3, "batch_size": 4,
                                    "max_grad_norm": None, "sigma_sampling": "uniform", "sigma_shift": 1.0},
                          optimizer={"weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_steps": steps // 10},
                          logging={"progress": False, "log_every": 100})
    started = time.perf_counter()
    build_trainer(config).run()
    trained = load_pipeline(config.output_dir, device="cpu")
    spec = trained.spec
    untouched = WanImageToVideoSpec(config.model, frame_rate=config.frame_rate)
    base = spec.pipeline(untouched.load_text_components(CPU), trained.vae, untouched.load_denoiser(CPU).eval())
    frames, height, width = config.data.frames, config.data.height, config.data.width
    clips = [read_clip(clip.video, ClipWindow(frames, height, width)) for clip in pair_samples(root)]
    targets = [spec.prepare_latents(trained.vae, clip[None])["latents_mean"] for clip in clips]
    for pipeline in (trained.pipeline, base):
        pipeline.set_progress_bar_config(disable=True)
    results = []
    for mode in ("extension", "inpaint"):
        conditions = {conditioning.MODE: torch.tensor([float(conditioning.code(mode))]),
                      conditioning.LATENTS: targets[0]}
        learnt = 1 - spec.given_region(conditions, targets[0].shape)
        for own in (0, 1):
            given = from_clip(mode, clips[own], 5)
            with torch.no_grad():
                after, before = (spec.sample(pipeline, CAPTION, frames=frames, height=height, width=width,
                                             num_inference_steps=20, generator=torch.Generator().manual_seed(1),
                                             given=given, output="latents").latents
                                 for pipeline in (trained.pipeline, base))
            error, other = learnt_error(after, targets[own], learnt), learnt_error(after, targets[1 - own], learnt)
            untrained = learnt_error(before, targets[own], learnt)
            print(f"{mode}, clip {own}: relative error {error:.3f} (to the other clip {other:.3f}; untrained "
                  f"{untrained:.3f}) ({time.perf_counter() - started:.0f} s)")
            results.append((mode, own, error, other, untrained))
    for mode, own, error, other, untrained in results:
        assert error < other and error < 0.5 * untrained, (mode, own, error, other, untrained)
