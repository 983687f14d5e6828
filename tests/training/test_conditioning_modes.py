"""Conditioning modes in whole runs (ltx-video-i2v, and each other family with model.conditioning): the same losses
from the cache and on the fly, a stopped run resumed bit for bit, step 0 the base model's loss, and validation /
`vidtune sample` sampling in the mode through the family's condition pipeline (LTXConditionPipeline,
LTX2ConditionPipeline)."""

from __future__ import annotations

import time

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.helpers.datasets import captioned_dataset, masked_dataset, pair_samples
from tests.helpers.runs import run_stopped_at
from vidtune.cli import main as cli_main
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ModelError, VidtuneError
from vidtune.given_frames import from_clip, validation_given
from vidtune.models import conditioning
from vidtune.models.conditioning import Given
from vidtune.models.ltx_video import LTXVideoImageToVideoSpec
from vidtune.models.registry import get_spec_class
from vidtune.sampling import load_pipeline, sample_run
from vidtune.trainers import build_trainer

FAMILY = "ltx-video-i2v"
# Every mode drawn in a run of a few steps: two clips a batch, so batches mix token layouts (a last frame's extra
# tokens beside in-place regions) too.
MODES = {"extension": 0.25, "extension_frames": 5, "last_frame": 0.2, "first_last": 0.2, "inpaint": 0.25}
# The other families with modes: each once (two clips a batch) in the run tests below.
OTHER_FAMILIES = ["ltx-2", "cogvideox-i2v", "hunyuan-video-1.5-i2v"]
# The modes each family takes, where they are not all of them (CogVideoX has no mask channel to inpaint with).
FAMILY_MODES = {"cogvideox-i2v": {"extension": 0.3, "extension_frames": 5, "last_frame": 0.3, "first_last": 0.3}}
LTX_2_OVERFIT_STEPS = 300
LORA_FILE = "pytorch_lora_weights.safetensors"
CAPTION = "a shape moving"
CPU = torch.device("cpu")


def modes_config(make_config, tmp_path, name: str, family: str = FAMILY, **sections):
    training = {"steps": 3, "batch_size": 2, "seed": 0, **sections.pop("training", {})}
    return make_config(family, model={"conditioning": FAMILY_MODES.get(family, MODES), **sections.pop("model", {})},
                       training=training, output_dir=str(tmp_path / name), **sections)


def drawn_modes(trainer) -> list[float]:
    """Record the mode codes each visit draws in `trainer`'s run."""
    seen: list[float] = []
    original = trainer.spec.visit_conditions

    def visit(x0, positions, seed):
        drawn = original(x0, positions, seed)
        seen.extend(drawn[conditioning.MODE].tolist())
        return drawn

    trainer.spec.visit_conditions = visit
    return seen


@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_same_losses_from_the_cache_and_on_the_fly(make_config, tmp_path, batch_size):
    """One clip a batch, encoded one by one into the cache: exactly the losses of encoding on the fly. Two: the
    cache encodes clips in its own order, a training batch pairs them otherwise, and the VAE's float32 rounding
    depends on which clips it encodes together, so the losses agree to that rounding."""
    losses, modes = [], []
    for enabled in (False, True):
        trainer = build_trainer(modes_config(make_config, tmp_path, f"run-{enabled}",
                                             training={"steps": 4, "batch_size": batch_size},
                                             precompute={"enabled": enabled, "batch_size": batch_size,
                                                         "cache_dir": str(tmp_path / "cache")}))
        modes.append(drawn_modes(trainer))
        losses.append(trainer.run().losses)
    if batch_size == 1:
        assert losses[0] == losses[1]
    else:
        torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-6, atol=0)
    assert modes[0] == modes[1] and len(set(modes[0])) >= 3, modes[0]  # several modes, drawn alike


def test_a_stopped_run_resumes_bit_for_bit(make_config, tmp_path):
    settings = {"training": {"steps": 4}, "checkpoint": {"every": 2}}
    reference = build_trainer(modes_config(make_config, tmp_path, "reference", **settings)).run()
    run_stopped_at(build_trainer(modes_config(make_config, tmp_path, "stopped", **settings)), 3)
    resumed = build_trainer(modes_config(make_config, tmp_path, "stopped", training={"steps": 4},
                                         checkpoint={"every": 2, "resume": "latest"})).run()
    assert resumed.final_step == 4
    ours, theirs = load_file(tmp_path / "stopped" / LORA_FILE), load_file(tmp_path / "reference" / LORA_FILE)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert resumed.losses[-1] == reference.losses[-1]


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_the_cache_trains_as_on_the_fly_and_a_stopped_run_resumes_bit_for_bit(make_config, tmp_path, family):
    """Each other family, one clip a batch: a run encoding on the fly and one from the cache draw the same modes and
    the same losses (to float32 rounding: the cache's encoders run in their own stage, and the weights end ~1e-7
    apart); a run from the cache stopped at step 2 and resumed ends with the uninterrupted run's weights bit for
    bit."""
    settings = {"training": {"steps": 3, "batch_size": 1}, "checkpoint": {"every": 2}}
    cached = {"precompute": {"enabled": True, "cache_dir": str(tmp_path / "cache")}}
    on_the_fly = build_trainer(modes_config(make_config, tmp_path, "on-the-fly", family, **settings))
    modes = drawn_modes(on_the_fly)
    fly_losses = on_the_fly.run().losses
    reference = build_trainer(modes_config(make_config, tmp_path, "reference", family, **settings, **cached))
    cached_modes = drawn_modes(reference)
    cached_losses = reference.run().losses
    assert cached_modes == modes and len(set(modes)) >= 2, modes
    torch.testing.assert_close(torch.tensor(cached_losses), torch.tensor(fly_losses), rtol=1e-6, atol=0)
    run_stopped_at(build_trainer(modes_config(make_config, tmp_path, "stopped", family, **settings, **cached)), 2)
    resumed = build_trainer(modes_config(make_config, tmp_path, "stopped", family, training=settings["training"],
                                         checkpoint={"every": 2, "resume": "latest"}, **cached)).run()
    assert resumed.final_step == 3 and resumed.losses[-1] == cached_losses[-1]
    ours, theirs = load_file(tmp_path / "stopped" / LORA_FILE), load_file(tmp_path / "reference" / LORA_FILE)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)


@pytest.mark.parametrize("family", [FAMILY, *OTHER_FAMILIES])
def test_step_0_is_the_base_models_loss(make_config, tmp_path, family):
    """The adapter starts as the base model: the first batch's loss with it equals the base model's (a full
    fine-tune before its first step) exactly, under the same drawn modes."""
    losses = []
    for algorithm in ("lora", "full"):
        trainer = build_trainer(modes_config(make_config, tmp_path, algorithm, family,
                                             training={"algorithm": algorithm}))
        trainer.set_up()
        batch = next(trainer.context.source.batches(0))
        with torch.no_grad():
            losses.append(trainer.context.loss(trainer.context, batch).total)
    assert torch.equal(losses[0], losses[1])


def test_validation_and_sample_use_the_mode(make_config, tmp_path, shapes_dataset, monkeypatch):
    """Validation samples in the mode with the largest share (here extension: the first clip's first 5 frames as a
    video condition at frame 0); `vidtune sample --extend / --inpaint / --last-frame` sample the others."""
    config = modes_config(make_config, tmp_path, "run", training={"steps": 1, "batch_size": 1},
                          model={"conditioning": {**MODES, "extension": 0.4, "inpaint": 0.1}},
                          validation={"enabled": True, "every": 1, "num_inference_steps": 2})
    calls: list[dict] = []
    original = LTXVideoImageToVideoSpec.given_inputs

    def recorded(self, given, frames, height, width):
        inputs = original(self, given, frames, height, width)
        calls.append({"mode": given.mode, **inputs})
        return inputs

    LTXVideoImageToVideoSpec.given_inputs = recorded
    try:
        result = build_trainer(config).run()
        assert result.sample_paths and [call["mode"] for call in calls] == ["extension"]
        (condition,) = calls[0]["conditions"]
        assert condition.frame_index == 0 and len(condition.video) == 5
        run = load_pipeline(config.output_dir, device="cpu")
        clip = pair_samples(shapes_dataset)[0].video
        frame = tmp_path / "last.png"
        Image.new("RGB", (32, 32), (200, 30, 30)).save(frame)
        mask = tmp_path / "mask.png"
        Image.new("RGB", (32, 32), (255, 255, 255)).save(mask)
        for flags, mode in (({"inpaint": clip, "mask": mask}, "inpaint"), ({"last_frame": frame}, "last_frame"),
                            ({"last_frame": frame, "image": frame}, "first_last")):
            written = sample_run(run, "a red circle", tmp_path / f"{mode}.mp4", num_inference_steps=2, **flags)
            assert written.is_file() and calls[-1]["mode"] == mode
        assert float(calls[-3]["given_region"].sum()) == 0  # an all-white mask keeps nothing
        assert calls[-1]["conditions"][-1].frame_index == config.data.frames - 1
    finally:
        LTXVideoImageToVideoSpec.given_inputs = original
    with pytest.raises(VidtuneError, match="--extend and --inpaint: a sample takes one conditioning mode"):
        sample_run(run, "a red circle", tmp_path / "x.mp4", extend=clip, inpaint=clip)
    with pytest.raises(VidtuneError, match="--mask: the mask says which region"):
        sample_run(run, "a red circle", tmp_path / "x.mp4", mask=mask)
    # `vidtune sample` hands its flags on as paths.
    seen: dict = {}

    def recording(run, prompt, output, **flags):
        seen.update(flags)
        return written

    monkeypatch.setattr("vidtune.sampling.sample_run", recording)
    assert cli_main(["sample", config.output_dir, "--prompt", "a red circle", "--inpaint", str(clip), "--mask",
                     str(mask), "--last-frame", str(frame)]) == 0
    assert (seen["inpaint"], seen["mask"], seen["last_frame"]) == (clip, mask, frame) and "extend" not in seen


def test_a_family_without_the_mode_refuses_to_sample_it(make_config):
    spec = build_trainer(make_config("sana-video-i2v")).spec
    with pytest.raises(ModelError, match="sana-video-i2v cannot sample extension conditioning: SanaImageToVideo"):
        spec.sample(None, "a red circle", frames=9, height=32, width=32, num_inference_steps=2,
                    generator=torch.Generator(), given=Given("extension", frames=torch.zeros(5, 3, 32, 32)))


def learnt_error(sampled: torch.Tensor, x0: torch.Tensor, learnt: torch.Tensor) -> float:
    """Relative error over what a mode learns (the given region left out: it is the target's by construction)."""
    learnt = learnt.expand_as(x0)
    return float(((sampled - x0) * learnt).norm() / (x0 * learnt).norm())


@pytest.mark.slow
def test_each_mode_brings_back_the_clip_it_is_given(make_config, shapes_dataset, tmp_path):
    """Two clips with one caption, a full fine-tune drawing the four modes: sampled through LTXConditionPipeline
    from each clip's given frames (or kept region), what the sample learns is nearer that clip than the other, and
    well below the untrained model's error; only the conditioning tells the two apart."""
    root = captioned_dataset(shapes_dataset, tmp_path / "data", [CAPTION, CAPTION])
    steps = 400
    config = make_config(FAMILY, data_root=root,
                         model={"conditioning": {"extension": 0.25, "extension_frames": 5, "last_frame": 0.25,
                                                 "first_last": 0.25, "inpaint": 0.25}},
                         training={"algorithm": "full", "steps": steps, "learning_rate": 1e-2, "batch_size": 4,
                                   "max_grad_norm": None, "sigma_sampling": "uniform", "sigma_shift": 1.0},
                         optimizer={"weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_steps": steps // 10},
                         logging={"progress": False, "log_every": 100})
    started = time.perf_counter()
    build_trainer(config).run()
    trained = load_pipeline(config.output_dir, device="cpu")
    spec = trained.spec
    untouched = LTXVideoImageToVideoSpec(config.model, frame_rate=config.frame_rate)  # the base transformer
    base = spec.pipeline(untouched.load_text_components(CPU), trained.vae, untouched.load_denoiser(CPU).eval())
    frames, height, width = config.data.frames, config.data.height, config.data.width
    clips = [read_clip(clip.video, ClipWindow(frames, height, width)) for clip in pair_samples(root)]
    targets = [spec.prepare_latents(trained.vae, clip[None])["latents_mean"] for clip in clips]
    inpaint = conditioning.rectangle_region((0.25, 0.25, 0.75, 0.75), "inside", *targets[0].shape[2:])
    for pipeline in (trained.pipeline, base):
        pipeline.set_progress_bar_config(disable=True)
    for mode in ("extension", "last_frame", "first_last", "inpaint"):
        code = torch.tensor([float(conditioning.code(mode))])
        learnt = 1 - conditioning.region(code, targets[0].shape, 2, inpaint)
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
            assert error < other and error < 0.5 * untrained, (mode, own, error, other, untrained)


def test_inpainting_keeps_what_each_clips_mask_leaves_black(make_config, shapes_dataset, tmp_path):
    """A clip's `mask` input (masks.txt, white on the left half) decides what inpainting keeps: the right half of the
    latent grid is given, the left half learnt (not model.conditioning.mask_rectangle's centre)."""
    root = masked_dataset(shapes_dataset, tmp_path / "data", white=(0.0, 0.0, 0.5, 1.0))
    config = make_config(FAMILY, data={"root": None, "datasets": [{"type": "pairs", "root": str(root),
                                                                   "inputs": {"mask": "masks.txt"}}]},
                         model={"conditioning": {"inpaint": 1.0}}, training={"steps": 1})
    trainer = build_trainer(config)
    trainer.set_up()
    batch = next(trainer.context.source.batches(0))
    assert conditioning.INPUT_MASK in batch.latents
    x0 = batch.latents["latents_mean"]
    conditions = {**batch.latents, **trainer.spec.visit_conditions(x0, batch.positions, 0)}
    assert conditions[conditioning.MODE].tolist() == [float(conditioning.code("inpaint"))]
    given = trainer.spec.given_region(conditions, x0.shape)
    # The resized mask's edge is grey over the boundary column: learnt too (a cell is kept only when wholly black).
    width = x0.shape[-1]
    assert float(given[..., : width // 2 + 1].max()) == 0 and float(given[..., width // 2 + 1:].min()) == 1
    # Validation inpaints the first clip with its own mask.
    sampled = validation_given(trainer.spec, config, trainer.context.clips, 9, 32, 32)
    assert sampled is not None and sampled.mode == "inpaint" and sampled.mask is not None
    assert float(sampled.mask[:, :, :14].min()) > 0.9 and float(sampled.mask[:, :, 18:].max()) < 0.1


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_validation_and_sample_use_the_mode_in_each_family(make_config, tmp_path, shapes_dataset, family):
    """Validation samples in the configured mode, `vidtune sample --last-frame / --inpaint` in the others, each
    through the family's `given_inputs` (LTX-2: LTX2ConditionPipeline's conditions)."""
    modes = FAMILY_MODES.get(family, MODES)
    config = modes_config(make_config, tmp_path, "run", family, training={"steps": 1, "batch_size": 1},
                          model={"conditioning": {**modes, "validation_mode": "first_last"}},
                          validation={"enabled": True, "every": 1, "num_inference_steps": 2})
    spec_class = get_spec_class(family)
    calls: list[dict] = []
    original = spec_class.given_inputs

    def recorded(self, given, frames, height, width):
        inputs = original(self, given, frames, height, width)
        calls.append({"mode": given.mode, **inputs})
        return inputs

    spec_class.given_inputs = recorded
    try:
        result = build_trainer(config).run()
        assert result.sample_paths and [call["mode"] for call in calls] == ["first_last"]
        run = load_pipeline(config.output_dir, device="cpu")
        frame = tmp_path / "last.png"
        Image.new("RGB", (32, 32), (200, 30, 30)).save(frame)
        clip = pair_samples(shapes_dataset)[0].video
        for flags, mode in (({"last_frame": frame}, "last_frame"), ({"inpaint": clip}, "inpaint")):
            if mode not in modes:
                continue
            written = sample_run(run, "a red circle", tmp_path / f"{mode}.mp4", num_inference_steps=2, **flags)
            assert written.is_file() and calls[-1]["mode"] == mode
        assert "inpaint" not in modes or calls[-1]["given_region"].shape[2] == 3  # the rectangle on the latent grid
    finally:
        spec_class.given_inputs = original


@pytest.mark.slow
def test_ltx_2_brings_back_the_clip_it_is_given(make_config, shapes_dataset, tmp_path):
    """LTX-2, two clips with one caption, a full fine-tune extending each: sampled through LTX2ConditionPipeline from
    each clip's first frames, what the sample learns (its last latent frame) is nearer that clip than the other, and
    well below the untrained model's error; only the conditioning tells the two apart."""
    root = captioned_dataset(shapes_dataset, tmp_path / "data", [CAPTION, CAPTION])
    steps = LTX_2_OVERFIT_STEPS
    config = make_config("ltx-2", data_root=root,
                         # Both streams train together, as the pipeline samples them (silence beside each clip).
                         model={"conditioning": {"extension": 1.0, "extension_frames": 5},
                                "clips_without_sound": "silence"},
                         training={"algorithm": "full", "steps": steps, "learning_rate": 1e-2, "batch_size": 2,
                                   "max_grad_norm": None, "sigma_sampling": "uniform", "sigma_shift": 1.0},
                         optimizer={"weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_steps": steps // 10},
                         logging={"progress": False, "log_every": 100})
    started = time.perf_counter()
    build_trainer(config).run()
    trained = load_pipeline(config.output_dir, device="cpu")
    spec = trained.spec
    untouched = get_spec_class("ltx-2")(config.model, frame_rate=config.frame_rate)  # the base transformer
    base = spec.pipeline(untouched.load_text_components(CPU), trained.vae, untouched.load_denoiser(CPU).eval())
    frames, height, width = config.data.frames, config.data.height, config.data.width
    clips = [read_clip(clip.video, ClipWindow(frames, height, width)) for clip in pair_samples(root)]
    targets = [spec.prepare_latents(trained.vae, clip[None])["latents_mean"] for clip in clips]
    for pipeline in (trained.pipeline, base):
        pipeline.set_progress_bar_config(disable=True)
    for mode in ("extension",):
        code = torch.tensor([float(conditioning.code(mode))])
        learnt = 1 - conditioning.region(code, targets[0].shape, 2, torch.zeros(1, 1, *targets[0].shape[2:]))
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
            assert error < other and error < 0.5 * untrained, (mode, own, error, other, untrained)
