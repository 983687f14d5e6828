"""Wan Animate: training hands the transformer exactly what WanAnimatePipeline hands it (reference condition, CLIP
tokens, pose latents, face pixels); each sample's pose clip reaches the model alike from the cache and on the fly;
runs resume bit for bit; trained on two (pose, target) pairs, the pipeline given each pose brings back its target."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.datasets import CONTROL_CAPTION, control_dataset, masked_dataset
from tests.helpers.runs import run_stopped_at
from vidtune.algorithms.lora import module_suffixes
from vidtune.data.inputs import input_key
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ModelError
from vidtune.models.registry import get_spec_class
from vidtune.models.spec import CONTROL_LATENTS
from vidtune.models.tiny import TINY_SHAPES
from vidtune.models.wan_animate import BLANK_POSE, FACE_PIXELS, POSE_LATENTS
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
FAMILY = "wan-animate"


def _spec(config):
    return get_spec_class(FAMILY)(config.model, frame_rate=config.frame_rate)


def _transformer_inputs(denoiser: torch.nn.Module, call) -> dict[str, Any]:
    """The keyword inputs of the first transformer call `call()` makes."""
    seen: dict[str, Any] = {}

    def record(module, args, kwargs):
        if not seen:
            seen.update(kwargs)

    handle = denoiser.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            call()
    finally:
        handle.remove()
    return seen


def test_training_hands_the_transformer_what_the_pipeline_hands_it(make_config):
    config = make_config(FAMILY)
    spec = _spec(config)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU).eval()
    frames, height, width = TINY_SHAPES[FAMILY]
    generator = torch.Generator().manual_seed(0)
    # Videos of byte levels, as decoded clips are: the pipeline is handed pictures (bytes) of them.
    clip, pose, face = ((torch.randint(0, 256, (1, frames, 3, height, width), generator=generator) / 127.5 - 1)
                        for _ in range(3))
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    sampled = _transformer_inputs(denoiser, lambda: spec.sample(
        pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=1,
        generator=torch.Generator().manual_seed(0), reference=clip[0], output="latents",
        inputs={"pose": pose[0].transpose(0, 1), "face": face[0].transpose(0, 1)}))

    latents = spec.prepare_latents(vae, clip)
    conditions = {**spec.prepare_conditions(text, ["a red circle"]), **latents,
                  CONTROL_LATENTS: spec.prepare_latents(vae, pose)["latents_mean"],
                  FACE_PIXELS: spec.face_pixels(face.transpose(1, 2))}
    channels = latents["latents_mean"].shape[1]
    noisy = sampled["hidden_states"][:, :channels]
    assert noisy.shape == latents["latents_mean"].shape  # one latent frame more than the clip's: the reference's
    trained = _transformer_inputs(denoiser, lambda: spec.forward(denoiser, conditions, noisy, sampled["timestep"]))
    for key in ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_image", "pose_hidden_states",
                "face_pixel_values", "timestep"):
        assert trained[key].shape == sampled[key].shape, key
        assert torch.allclose(trained[key].float(), sampled[key].float(), atol=1e-5), key
    # The pose and the face do reach the model: other ones change its prediction.
    with torch.no_grad():
        prediction = spec.forward(denoiser, conditions, noisy, sampled["timestep"])
        without_pose = spec.forward(denoiser, {k: v for k, v in conditions.items() if k != CONTROL_LATENTS}, noisy,
                                    sampled["timestep"])
        without_face = spec.forward(denoiser, {k: v for k, v in conditions.items() if k != FACE_PIXELS}, noisy,
                                    sampled["timestep"])
    assert (prediction - without_pose).abs().max() > 1e-4 and (prediction - without_face).abs().max() > 1e-4


def test_without_pose_or_face_training_and_sampling_see_black_videos(make_config):
    """A sample without a pose clip trains on the latents of a black pose video, and the pipeline given no pose
    samples from the same; a pose video shorter than the sample is refused with what to do."""
    config = make_config(FAMILY)
    spec = _spec(config)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU).eval()
    frames, height, width = TINY_SHAPES[FAMILY]
    clip = torch.rand(1, frames, 3, height, width, generator=torch.Generator().manual_seed(0)) * 2 - 1
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)

    def sample(**inputs):
        return spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width,
                           num_inference_steps=1, generator=torch.Generator().manual_seed(0), reference=clip[0],
                           output="latents", inputs=inputs or None)

    sampled = _transformer_inputs(denoiser, sample)
    latents = spec.prepare_latents(vae, clip)
    assert torch.allclose(sampled["pose_hidden_states"], latents[BLANK_POSE], atol=1e-5)
    assert torch.equal(sampled["face_pixel_values"], torch.full_like(sampled["face_pixel_values"], -1.0))
    with pytest.raises(ModelError, match=r"the pose video has shape \(3, 5, 32, 32\); it needs \[3, F, H, W\] with "
                                         r"at least 9 frames"):
        sample(pose=torch.zeros(3, 5, height, width))
    with pytest.raises(ModelError, match=r"wan-animate samples from no mask input \(it takes: pose, face, "
                                         r"reference_images\)"):
        sample(mask=torch.zeros(3, frames, height, width))


def test_pose_clips_reach_the_model_alike_from_the_cache_and_on_the_fly(make_config, shapes_dataset, tmp_path):
    """With plain LoRA training (no control algorithm), each sample's control clip is its pose: the cache encodes it
    beside the clip, and a run from the cache logs the losses of a run encoding on the fly."""
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    batches, losses = {}, {}
    for cached in (False, True):
        config = make_config(FAMILY, data_root=root, training={"batch_size": 2, "steps": 2},
                             # One clip per VAE call, as on the fly: the same computation, the same values.
                             precompute={"enabled": cached, "cache_dir": str(tmp_path / "cache"), "batch_size": 1},
                             logging={"progress": False, "log_every": 1}, output_dir=str(tmp_path / f"run-{cached}"))
        trainer = build_trainer(config)
        batches[cached] = next(trainer.set_up().source.batches(0))
        trainer.run()
        metrics = (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()
        losses[cached] = [json.loads(row)["loss"] for row in metrics if "loss" in json.loads(row)]
    on_the_fly, from_cache = batches[False], batches[True]
    pose = on_the_fly.latents[CONTROL_LATENTS]
    assert pose.shape == on_the_fly.latents["latents_mean"].shape
    assert torch.allclose(from_cache.latents[CONTROL_LATENTS], pose, atol=1e-6)
    assert not torch.allclose(pose, on_the_fly.latents["latents_mean"], atol=1e-2)  # the pose clips', not targets'
    assert len(losses[False]) == 2 and losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_a_resumed_run_ends_bit_for_bit_like_one_left_alone(make_config, shapes_dataset, tmp_path):
    """Half the samples drawn as later segments: the draws follow the visits, so the resumed run draws alike."""
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    settings = {"training": {"steps": 5, "learning_rate": 1e-2}, "checkpoint": {"every": 2},
                "model": {"animate_segment_conditioning": 0.5}}
    build_trainer(make_config(FAMILY, data_root=root, **settings, output_dir=str(tmp_path / "reference"))).run()
    trainer = build_trainer(make_config(FAMILY, data_root=root, **settings, output_dir=str(tmp_path / "stopped")))
    run_stopped_at(trainer, 3)
    resumed = {**settings, "checkpoint": {**settings["checkpoint"], "resume": "latest"}}
    result = build_trainer(make_config(FAMILY, data_root=root, **resumed, output_dir=str(tmp_path / "stopped"))).run()
    assert result.final_step == 5
    expected, got = (load_file(tmp_path / run / "pytorch_lora_weights.safetensors") for run in ("reference", "stopped"))
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(expected[key], got[key]) for key in expected)


def test_short_lora_target_names_never_name_a_module_holding_others():
    """Wan Animate's face adapters end in a Linear `to_out`, its blocks' attention in a list `to_out` holding
    `to_out.0`: `all-linear` names the adapters' whole path, so peft wraps no list."""
    names = ["blocks.0.attn1.to_q", "blocks.0.attn1.to_out.0", "face_adapter.0.to_q", "face_adapter.0.to_out",
             "proj_out"]
    assert module_suffixes(names) == ["attn1.to_out.0", "attn1.to_q", "face_adapter.0.to_out", "proj_out", "to_q"]


def _sampled(spec, pipeline, vae, target: Path, pose: Path, steps: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target clip's latents, what the pipeline samples from its first frame following `pose`)."""
    frames, height, width = TINY_SHAPES[FAMILY]
    clip = read_clip(target, ClipWindow(frames, height, width))
    x0 = spec.prepare_latents(vae, clip[None])["latents_mean"]
    pose_video = read_clip(pose, ClipWindow(frames, height, width)).transpose(0, 1)
    with torch.no_grad():
        sampled = spec.sample(pipeline, CONTROL_CAPTION, frames=frames, height=height, width=width,
                              num_inference_steps=steps, generator=torch.Generator().manual_seed(1), reference=clip,
                              inputs={"pose": pose_video}, output="latents").latents
    return x0, sampled


@pytest.mark.slow
def test_two_pose_target_pairs_come_back_through_the_pipeline(make_config, shapes_dataset, tmp_path):
    root, targets, poses = control_dataset(shapes_dataset, tmp_path / "data")
    steps = 400
    config = make_config(FAMILY, data_root=root,
                         training={"algorithm": "full", "steps": steps, "learning_rate": 3e-3, "batch_size": 4,
                                   "max_grad_norm": None, "sigma_sampling": "uniform", "sigma_shift": 1.0},
                         optimizer={"weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_steps": steps // 10},
                         precompute={"enabled": True, "cache_dir": str(tmp_path / "cache")},
                         logging={"progress": False, "log_every": 100})
    started = time.perf_counter()
    result = build_trainer(config).run()
    spec = _spec(config)
    text, vae = spec.load_text_components(CPU), spec.load_vae(CPU)
    trained = spec.pipeline(text, vae, type(spec.load_denoiser(CPU)).from_pretrained(result.weights_path).eval())
    base = spec.pipeline(text, vae, spec.load_denoiser(CPU).eval())
    for pipeline in (trained, base):
        pipeline.set_progress_bar_config(disable=True)
    errors = {}
    for name, target, pose in (("A", targets[0], poses[0]), ("B", targets[1], poses[1])):
        x0, after = _sampled(spec, trained, vae, target, pose)
        _, before = _sampled(spec, base, vae, target, pose)
        other = spec.prepare_latents(vae, read_clip(targets[1 - "AB".index(name)],
                                                    ClipWindow(*TINY_SHAPES[FAMILY]))[None])["latents_mean"]
        errors[name] = (float((after - x0).norm() / x0.norm()), float((after - other).norm() / other.norm()),
                        float((before - x0).norm() / x0.norm()))
        print(f"{FAMILY}: target {name}: relative error {errors[name][0]:.3f} (to the other target "
              f"{errors[name][1]:.3f}; untrained {errors[name][2]:.3f}) ({time.perf_counter() - started:.0f} s)")
    for name, (own, other, untrained) in errors.items():
        assert own < other, f"target {name}: nearer the other target ({own:.3f} vs {other:.3f})"
        assert own < 0.3 * untrained, f"target {name}: {own:.3f} vs untrained {untrained:.3f}"


def test_validation_samples_follow_the_first_clips_pose(make_config, shapes_dataset, tmp_path, monkeypatch):
    """Validation hands the pipeline the first sample's control clip as its pose video, read at the samples' shape."""
    root, _, poses = control_dataset(shapes_dataset, tmp_path / "data")
    config = make_config(FAMILY, data_root=root, training={"steps": 1}, validation={"enabled": True})
    trainer = build_trainer(config)
    seen: list[dict[str, torch.Tensor] | None] = []
    original = type(trainer.spec).sample

    def recording(spec, *args, **kwargs):
        seen.append(kwargs.get("inputs"))
        return original(spec, *args, **kwargs)

    monkeypatch.setattr(type(trainer.spec), "sample", recording)
    trainer.run()
    frames, height, width = TINY_SHAPES[FAMILY]
    expected = read_clip(poses[0], ClipWindow(frames, height, width)).transpose(0, 1)
    assert seen and all(inputs is not None and torch.equal(inputs["pose"], expected) for inputs in seen)


def test_pose_and_face_inputs_reach_the_model_alike_from_the_cache_and_on_the_fly(make_config, shapes_dataset,
                                                                                     tmp_path):
    """A dataset's `pose` and `face` inputs (poses.txt, faces.txt beside videos.txt) are read with each clip's
    window, encoded as the pipeline encodes them (the pose's argmax latents, the face at the motion encoder's size)
    and cached under their own identity: from the cache, the same tensors and losses as on the fly."""
    root, _, others = control_dataset(shapes_dataset, tmp_path / "data")
    (root / "controls.txt").unlink()  # the pose comes from the inputs alone
    (root / "poses.txt").write_text("".join(f"{path}\n" for path in others))
    (root / "faces.txt").write_text("".join(f"{path}\n" for path in reversed(others)))
    entry = {"type": "pairs", "root": str(root), "inputs": {"pose": "poses.txt", "face": "faces.txt"}}
    batches, losses = {}, {}
    for cached in (False, True):
        config = make_config(FAMILY, data={"root": None, "datasets": [entry]},
                             training={"batch_size": 2, "steps": 2},
                             precompute={"enabled": cached, "cache_dir": str(tmp_path / "cache"), "batch_size": 1},
                             logging={"progress": False, "log_every": 1}, output_dir=str(tmp_path / f"run-{cached}"))
        trainer = build_trainer(config)
        batches[cached] = next(trainer.set_up().source.batches(0))
        trainer.run()
        metrics = (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()
        losses[cached] = [json.loads(row)["loss"] for row in metrics if "loss" in json.loads(row)]
    on_the_fly, from_cache = batches[False], batches[True]
    spec = _spec(config)
    vae = spec.load_vae(CPU)
    frames, height, width = TINY_SHAPES[FAMILY]
    order = on_the_fly.indices.tolist()
    clips = {name: torch.stack([read_clip(paths[i], ClipWindow(frames, height, width)) for i in order])
             for name, paths in (("pose", others), ("face", list(reversed(others))))}
    expected_pose = spec.prepare_latents(vae, clips["pose"])["latents_mean"][:, :, 1:]
    expected_face = spec.face_pixels(clips["face"].transpose(1, 2))
    for batch in (on_the_fly, from_cache):
        assert torch.allclose(batch.latents[POSE_LATENTS], expected_pose, atol=1e-5)
        assert torch.allclose(batch.latents[FACE_PIXELS], expected_face, atol=1e-6)
    assert len(losses[False]) == 2 and losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_a_masked_run_weights_the_reference_position_by_the_first_frames_mask(make_config, shapes_dataset, tmp_path):
    """`training.masked_loss`: the mask reaches the latents' reference position too (the first frame's), so a
    masked run trains; a mask white on the right half weights the right half of every latent frame."""
    root = masked_dataset(shapes_dataset, tmp_path / "data", white=(0.5, 0.0, 1.0, 1.0))
    entry = {"type": "pairs", "root": str(root), "inputs": {"mask": "masks.txt"}}
    config = make_config(FAMILY, data={"root": None, "datasets": [entry]},
                         training={"steps": 1, "masked_loss": True, "batch_size": 2})
    trainer = build_trainer(config)
    batch = next(trainer.set_up().source.batches(0))
    weights = batch.latents[input_key("mask")]
    assert weights.shape[2] == batch.latents["latents_mean"].shape[2]  # one more than the clip's latent frames
    half = weights.shape[-1] // 2
    # (the mask's edge is resized with the clip: a little grey at the middle)
    assert weights[..., :half].max() < 0.05 and weights[..., half:].min() > 0.95
    assert trainer.run().final_step == 1


def test_vidtune_plan_traces_the_released_model_offline():
    """`vidtune plan` for Wan2.2-Animate-14B from the shipped architecture: its motion encoder's blocks, which narrow
    as they go, are traced whole (only the transformer's repeated blocks are traced in part)."""
    from vidtune.config import build_config
    from vidtune.memory.plan import GIB, plan_memory

    config = build_config({"model": {"name": FAMILY, "pretrained": "Wan-AI/Wan2.2-Animate-14B-Diffusers"},
                           "data": {"root": ".", "frames": 9, "height": 64, "width": 64},
                           "lora": {"rank": 4, "alpha": 4}, "precompute": {"enabled": True}})
    plan = plan_memory(config)
    assert plan.peak > 17.3e9 * 2 / 1.08  # at least the bf16 transformer (17.3B parameters) is counted
    print(f"planned peak {plan.peak / GIB:.1f} GiB")


def _byte_video(generator: torch.Generator, frames: int, height: int, width: int) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1] at byte levels, as a decoded input is."""
    return torch.randint(0, 256, (3, frames, height, width), generator=generator) / 127.5 - 1


def test_replace_mode_and_the_character_image_reach_the_transformer_as_the_pipeline_hands_them(make_config):
    """Replace mode: the condition's clip part is the background's latents under the pipeline's mask channels of what
    it keeps (a grey-level mask), and a `reference_images` input is the character image (latents at the reference
    position of the condition and the target, CLIP tokens), exactly as WanAnimatePipeline(mode="replace") hands them
    to the transformer; a mask does change the prediction."""
    from vidtune.models.wan_animate import KEPT_MASK, REFERENCE_CONDITION

    config = make_config(FAMILY, model={"animate_mode": "replace"})
    spec = _spec(config)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU).eval()
    frames, height, width = TINY_SHAPES[FAMILY]
    generator = torch.Generator().manual_seed(0)
    clip, pose, face, background = (_byte_video(generator, frames, height, width) for _ in range(4))
    mask = _byte_video(generator, frames, height, width)  # grey levels: the pipeline keeps them
    # The character image as the inputs layer reads it: fitted inside the clip's size (black bars) keeping its aspect.
    character = _byte_video(generator, 1, height, width)
    character[:, :, :, :6] = -1.0
    inputs = {"pose": pose, "face": face, "background": background, "mask": mask, "reference_images": character}
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    sampled = _transformer_inputs(denoiser, lambda: spec.sample(
        pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=1,
        generator=torch.Generator().manual_seed(0), reference=clip.transpose(0, 1), output="latents", inputs=inputs))

    latents = spec.prepare_latents(vae, clip.transpose(0, 1)[None])
    batch = {kind: [value[None]] if kind == "reference_images" else value[None] for kind, value in inputs.items()}
    encoded = {**latents, **spec.encode_inputs(vae, batch, latents)}
    conditions = {**spec.prepare_conditions(text, ["a red circle"]), **encoded}
    channels = latents["latents_mean"].shape[1]
    noisy = sampled["hidden_states"][:, :channels]
    trained = _transformer_inputs(denoiser, lambda: spec.forward(denoiser, conditions, noisy, sampled["timestep"]))
    for key in ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_image", "pose_hidden_states",
                "face_pixel_values", "timestep"):
        assert trained[key].shape == sampled[key].shape, key
        assert torch.allclose(trained[key].float(), sampled[key].float(), atol=1e-5), key
    # The character image, not the clip's first frame, is the target at the reference position.
    assert torch.equal(encoded["latents_mean"][:, :, :1], encoded[REFERENCE_CONDITION][:, 4:, :1])
    assert not torch.allclose(encoded["latents_mean"][:, :, :1], latents["latents_mean"][:, :, :1], atol=1e-3)
    assert torch.equal(encoded["latents_mean"][:, :, 1:], latents["latents_mean"][:, :, 1:])
    with torch.no_grad():
        inverted = {**conditions, KEPT_MASK: 1 - conditions[KEPT_MASK]}
        change = spec.forward(denoiser, conditions, noisy, sampled["timestep"]) - spec.forward(
            denoiser, inverted, noisy, sampled["timestep"])
    assert change.abs().max() > 1e-4


def test_a_later_segment_is_conditioned_as_the_pipeline_conditions_it(make_config):
    """`model.animate_segment_conditioning`: a sample drawn as a later segment is conditioned on its clip's first
    `animate_segment_frames` frames as WanAnimatePipeline conditions a segment after the first on the previous
    one's last frames (`prepare_prev_segment_cond_latents`); about that share of visits draw it; other families and
    replace mode refuse the settings before loading."""
    from vidtune.errors import ConfigError
    from vidtune.models.wan_animate import LATER_SEGMENT, SEGMENT_CONDITION

    for given in (1, 5):
        config = make_config(FAMILY, model={"animate_segment_conditioning": 0.5, "animate_segment_frames": given})
        spec = _spec(config)
        vae = spec.load_vae(CPU)
        frames, height, width = TINY_SHAPES[FAMILY]
        clip = _byte_video(torch.Generator().manual_seed(given), frames, height, width)
        latents = spec.prepare_latents(vae, clip.transpose(0, 1)[None])
        pipeline = spec.pipeline(spec.load_text_components(CPU), vae, spec.load_denoiser(CPU))
        with torch.no_grad():
            expected = pipeline.prepare_prev_segment_cond_latents(
                clip[None, :, :given], segment_frame_length=frames, start_frame=frames - given, height=height,
                width=width, prev_segment_cond_frames=given, task="animate", device=CPU)
        assert torch.allclose(latents[SEGMENT_CONDITION], expected, atol=1e-5)
        conditions = {**latents, LATER_SEGMENT: torch.ones(1)}
        assert torch.equal(spec.condition(conditions)[:, :, 1:], latents[SEGMENT_CONDITION])
        assert torch.equal(spec.condition({**latents, LATER_SEGMENT: torch.zeros(1)}),
                           spec.condition({k: v for k, v in latents.items() if k != SEGMENT_CONDITION}))
    drawn = spec.visit_conditions(latents["latents_mean"].expand(400, -1, -1, -1, -1), torch.arange(400), 0)
    assert 0.4 < float(drawn[LATER_SEGMENT].mean()) < 0.6
    with pytest.raises(ConfigError, match="wan has no animate mode nor segments"):
        other = make_config("wan", model={"animate_mode": "replace"})
        get_spec_class("wan")(other.model).check_frame_settings(other, [])
    with pytest.raises(ConfigError, match="animate_mode=replace: a later segment"):
        replace = make_config(FAMILY, model={"animate_mode": "replace", "animate_segment_conditioning": 0.5})
        _spec(replace).check_frame_settings(replace, [])


def _animate_dataset(shapes_dataset: Path, root: Path) -> tuple[dict[str, Any], list[Path]]:
    """Two clips with a pose clip, a background clip, a mask (a still, white on the right half) and a character
    image of another aspect each, as list files beside videos.txt. Returns (its dataset entry, the images)."""
    from PIL import Image

    from tests.helpers.datasets import write_mask

    root, _, others = control_dataset(shapes_dataset, root)
    (root / "controls.txt").unlink()
    images = []
    for number in range(2):
        pixels = torch.randint(0, 256, (40, 24, 3), generator=torch.Generator().manual_seed(number), dtype=torch.uint8)
        images.append(root / f"character{number}.png")
        Image.fromarray(pixels.numpy()).save(images[-1])
        write_mask(root / f"mask{number}.png", 48, 48, white=(0.5, 0.0, 1.0, 1.0))
    (root / "poses.txt").write_text("".join(f"{path}\n" for path in others))
    (root / "backgrounds.txt").write_text("".join(f"{path}\n" for path in reversed(others)))
    (root / "masks.txt").write_text("mask0.png\nmask1.png\n")
    (root / "references.txt").write_text("".join(f"{path.name}\n" for path in images))
    inputs = {"pose": "poses.txt", "background": "backgrounds.txt", "mask": "masks.txt",
              "reference_images": "references.txt"}
    return {"type": "pairs", "root": str(root), "inputs": inputs}, images


@pytest.mark.parametrize("mode", ["replace", "animate"])
def test_replace_mode_and_later_segments_train_alike_from_the_cache_and_on_the_fly(
        make_config, shapes_dataset, tmp_path, monkeypatch, mode):
    """Replace mode (background and mask inputs) and animate mode with later segments, each with a character image
    per clip: the cache holds what on-the-fly training encodes (same tensors, same losses); validation in replace
    mode samples from the first clip's pose, character image, background and mask."""
    from vidtune.data.input_files import read_input
    from vidtune.models.wan_animate import BACKGROUND_LATENTS, KEPT_MASK, SEGMENT_CONDITION
    from vidtune.sampling import SampleSettings, clip_sampling_inputs

    entry, images = _animate_dataset(shapes_dataset, tmp_path / "data")
    model = ({"animate_mode": "replace"} if mode == "replace"
             else {"animate_segment_conditioning": 0.5, "animate_segment_frames": 5})
    batches, losses = {}, {}
    for cached in (False, True):
        config = make_config(FAMILY, model=model, data={"root": None, "datasets": [entry]},
                             training={"batch_size": 2, "steps": 2},
                             precompute={"enabled": cached, "cache_dir": str(tmp_path / "cache"), "batch_size": 1},
                             logging={"progress": False, "log_every": 1}, output_dir=str(tmp_path / f"run-{cached}"))
        trainer = build_trainer(config)
        batches[cached] = next(trainer.set_up().source.batches(0))
        trainer.run()
        metrics = (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()
        losses[cached] = [json.loads(row)["loss"] for row in metrics if "loss" in json.loads(row)]
    on_the_fly, from_cache = batches[False], batches[True]
    assert on_the_fly.latents.keys() == from_cache.latents.keys()
    own = {BACKGROUND_LATENTS, KEPT_MASK} if mode == "replace" else {SEGMENT_CONDITION}
    assert own <= on_the_fly.latents.keys()
    for key, value in on_the_fly.latents.items():
        assert torch.allclose(from_cache.latents[key], value, atol=1e-5), key
    assert len(losses[False]) == 2 and losses[True] == pytest.approx(losses[False], rel=1e-5)
    # Validation and `vidtune sample` read the first clip's inputs for the pipeline as training read them.
    clip = trainer.context.clips[0]
    settings = SampleSettings.from_config(config, trainer.spec, default_prompt=CONTROL_CAPTION)
    sampling = clip_sampling_inputs(trainer.spec, clip, settings, config.data.fps)
    assert sampling is not None
    assert set(sampling) == {"pose", "reference_images", *(("background", "mask") if mode == "replace" else ())}
    window = ClipWindow(settings.frames, settings.height, settings.width)
    for kind, value in sampling.items():
        read = read_input(clip, kind, window)
        assert torch.equal(value, read[0] if kind == "reference_images" else read), kind
    if mode == "animate":  # `vidtune sample --image`: that picture is the character image, not the clip's
        from vidtune.cli import main as cli_main

        seen: list[dict[str, torch.Tensor]] = []
        original = type(trainer.spec).call_pipeline

        def recording(spec, pipeline, *args, **kwargs):
            seen.append(kwargs.get("inputs") or {})
            return original(spec, pipeline, *args, **kwargs)

        monkeypatch.setattr(type(trainer.spec), "call_pipeline", recording)
        assert cli_main(["sample", config.output_dir, "--prompt", CONTROL_CAPTION, "--steps", "1", "--device", "cpu",
                         "--image", str(images[1]), "--output", str(tmp_path / "s.mp4")]) == 0
        assert seen and "reference_images" not in seen[0] and "pose" in seen[0]


def test_clips_without_what_their_mode_needs_are_named_before_loading(make_config, shapes_dataset, tmp_path):
    """Replace mode names each clip without a background (file and line); a clip with two character images is
    named too (the pipeline animates one)."""
    from vidtune.errors import DataError

    entry, images = _animate_dataset(shapes_dataset, tmp_path / "data")
    replace = {**entry, "inputs": {kind: file for kind, file in entry["inputs"].items() if kind != "background"}}
    config = make_config(FAMILY, model={"animate_mode": "replace"}, data={"root": None, "datasets": [replace]})
    with pytest.raises(DataError, match=r"videos.txt line 2.*it has no background, which this run needs"):
        build_trainer(config).set_up()
    (Path(entry["root"]) / "references.txt").write_text(f"{images[0].name}\n{images[0].name}|{images[1].name}\n")
    config = make_config(FAMILY, data={"root": None, "datasets": [entry]})
    with pytest.raises(DataError, match=r"line 2 \(.*\) has 2 reference images"):
        build_trainer(config).set_up()


def test_the_lora_starts_from_the_base_model_in_wan_animate_pipeline(make_config, shapes_dataset, tmp_path):
    """Step 0: the adapter as training starts (lora_B zero) loaded with WanAnimatePipeline.load_lora_weights samples
    exactly what the base model samples; the trained one samples something else."""
    config = make_config(FAMILY, training={"steps": 1, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4})
    build_trainer(config).run()
    spec = _spec(config)
    frames, height, width = TINY_SHAPES[FAMILY]
    clip = _byte_video(torch.Generator().manual_seed(0), frames, height, width).transpose(0, 1)
    text, vae = spec.load_text_components(CPU), spec.load_vae(CPU)

    def sample(weights: dict[str, torch.Tensor] | None) -> torch.Tensor:
        pipeline = spec.pipeline(text, vae, spec.load_denoiser(CPU).eval())
        pipeline.set_progress_bar_config(disable=True)
        if weights is not None:
            pipeline.load_lora_weights(weights)
        return spec.sample(pipeline, CONTROL_CAPTION, frames=frames, height=height, width=width,
                           num_inference_steps=2, generator=torch.Generator().manual_seed(0), reference=clip,
                           output="latents").latents

    trained = load_file(Path(config.output_dir) / "pytorch_lora_weights.safetensors")
    plain = sample(None)
    assert torch.equal(sample({key: torch.zeros_like(value) if "lora_B" in key else value
                               for key, value in trained.items()}), plain)
    assert (sample(trained) - plain).abs().max() > 1e-4


def test_the_released_architecture_counts_the_published_14b_backbone_and_what_animate_adds():
    """The shipped architecture of Wan2.2-Animate-14B (what `vidtune plan` reads) holds 17.27B parameters: the
    published 14B of Wan 2.1's text-to-video backbone, Wan 2.1 I2V's image cross-attention (2.1B), the face
    adapters (0.84B) and the motion and face encoders; as Comfy-Org's bf16 file of 34.55 GB."""
    from diffusers import WanAnimateTransformer3DModel

    from vidtune.memory.architectures import families  # noqa: F401  (the module that ships the file)

    path = Path(__file__).parents[2] / "vidtune" / "memory" / "architectures.json"
    config = json.loads(path.read_text())["Wan-AI/Wan2.2-Animate-14B-Diffusers"]["components"]["transformer"]
    with torch.device("meta"):
        model = WanAnimateTransformer3DModel(**{key: value for key, value in config.items() if key[0] != "_"})
    counts = {"image": 0, "animate": 0, "backbone": 0}
    for name, parameter in model.named_parameters():
        part = ("animate" if name.split(".")[0] in ("face_adapter", "face_encoder", "motion_encoder",
                                                     "pose_patch_embedding")
                else "image" if any(key in name for key in ("add_k_proj", "add_v_proj", "norm_added_k",
                                                            "image_embedder"))
                else "backbone")
        counts[part] += parameter.numel()
    assert 17.25e9 < sum(counts.values()) < 17.30e9
    assert 14.0e9 < counts["backbone"] < 14.4e9  # Wan 2.1 T2V-14B: 14.29B
    assert 0.85e9 < counts["animate"] < 0.9e9 and 2.0e9 < counts["image"] < 2.2e9
