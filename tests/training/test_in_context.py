"""In-context LoRA (LTX-2's IC-LoRA): each sample's control clip joins the sequence as clean reference tokens, placed
as LTX2InContextPipeline places them; the adapter starts as the base model, resumes bit for bit, trains alike from the
cache and on the fly, samples through LTX2InContextPipeline, and two (reference, target) pairs overfit through it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.helpers.datasets import CONTROL_CAPTION, control_dataset
from tests.helpers.runs import run_stopped_at
from vidtune.algorithms.build import build_part, build_spec
from vidtune.algorithms.losses import clip_losses, noisy_inputs
from vidtune.data.dataset import VideoCaptionDataset
from vidtune.data.sources import load_dataset, read_sources
from vidtune.data.video import ClipWindow, read_clip, write_video
from vidtune.errors import ConfigError, DataError
from vidtune.in_context import FACTOR_KEY, read_reference, recorded_factor, referenced
from vidtune.models.in_context import append_reference
from vidtune.models.tiny import TINY_SHAPES
from vidtune.outputs import LORA_WEIGHTS, comfyui_lora_weights
from vidtune.processors import control_downscale, with_reference_controls
from vidtune.sampling import load_pipeline, sample_run
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
FAMILY = "ltx-2"
IN_CONTEXT = {"algorithm": "in-context-lora"}


def in_context_config(make_config, root: Path, factor: int = 2, **sections):
    training = {**IN_CONTEXT, **sections.pop("training", {})}
    return make_config(FAMILY, data_root=root, training=training,
                       control={"reference_downscale_factor": factor, **sections.pop("control", {})}, **sections)


@pytest.mark.parametrize("factor", [1, 2])
def test_reference_tokens_are_placed_as_the_in_context_pipeline_places_them(make_config, shapes_dataset, tmp_path,
                                                                             factor):
    """The tokens, per-token timesteps and rotary coordinates training builds are those LTX2InContextPipeline hands
    its transformer for the same reference clip."""
    root, _, controls = control_dataset(shapes_dataset, tmp_path / "data")
    config = in_context_config(make_config, root, factor)
    spec = build_spec(config)
    denoiser = spec.load_denoiser(CPU).eval()
    vae = spec.load_vae(CPU)
    pipeline = spec.in_context_pipeline(spec.pipeline(spec.load_text_components(CPU), vae, denoiser))
    pipeline.set_progress_bar_config(disable=True)
    frames, height, width = TINY_SHAPES[FAMILY]
    reference = read_reference(controls[0], frames, height, width, factor)
    captured: dict = {}
    hook = denoiser.register_forward_pre_hook(lambda _m, _a, kwargs: captured.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        spec.sample(referenced(spec, pipeline, reference, factor, 1.0), CONTROL_CAPTION, frames=frames,
                    height=height, width=width, num_inference_steps=1, generator=torch.Generator().manual_seed(0),
                    output="latents")
    hook.remove()
    spatial, temporal = spec.compression[:2]
    shape = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
    video_tokens = shape[0] * shape[1] * shape[2]
    sent = captured["hidden_states"]
    assert sent.shape[1] == video_tokens + video_tokens // factor**2  # the reference's tokens follow the video's
    latents = spec.prepare_latents(vae, reference[None])["latents_mean"]
    tokens, timesteps, placed = append_reference(denoiser, sent[:, :video_tokens], captured["timestep"][:, 0],
                                                 latents, shape, captured["fps"])
    assert torch.allclose(tokens, sent, atol=1e-5)
    assert torch.equal(timesteps, captured["timestep"]) and bool((timesteps[:, video_tokens:] == 0).all())
    assert torch.equal(placed["video_coords"], captured["video_coords"])


def test_step_0_is_the_base_model_and_the_reference_is_seen(make_config, shapes_dataset, tmp_path, capsys):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    trainer = build_trainer(in_context_config(make_config, root, training={"batch_size": 2}))
    context = trainer.set_up()
    assert "ltx-2: every sample trains video only, cut off from the audio stream" in capsys.readouterr().out
    batch = next(context.source.batches(0))
    inputs = noisy_inputs(context, batch)
    base = build_spec(context.config).load_denoiser(CPU)
    with torch.no_grad():
        adapted, untouched = clip_losses(context, inputs), clip_losses(context, inputs, denoiser=base)
        assert torch.equal(adapted, untouched)
        # Each sample's prediction depends on its own reference: given the other sample's, its error changes.
        swapped = {**inputs.conditions,
                   "control_latents": inputs.conditions["control_latents"].flip(0)}
        inputs.conditions = swapped
        assert not torch.allclose(clip_losses(context, inputs, denoiser=base), untouched)


def test_a_resumed_in_context_run_ends_bit_for_bit_like_one_left_alone(make_config, shapes_dataset, tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    settings = {"training": {"steps": 5, "learning_rate": 1e-2, "ema_decay": 0.8},
                "checkpoint": {"every": 2}, "lora": {"dropout": 0.1}}
    build_trainer(in_context_config(make_config, root, **settings, output_dir=str(tmp_path / "reference"))).run()
    trainer = build_trainer(in_context_config(make_config, root, **settings, output_dir=str(tmp_path / "stopped")))
    run_stopped_at(trainer, 3)
    resumed = {**settings, "checkpoint": {**settings["checkpoint"], "resume": "latest"}}
    assert build_trainer(in_context_config(make_config, root, **resumed,
                                           output_dir=str(tmp_path / "stopped"))).run().final_step == 5
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    for name in (LORA_WEIGHTS, "pytorch_lora_weights_ema.safetensors"):
        expected, got = load_file(reference / name), load_file(stopped / name)
        assert expected.keys() == got.keys() and expected
        assert all(torch.equal(expected[key], got[key]) for key in expected), name
    losses = [[json.loads(row)["loss"] for row in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (reference, stopped)]
    assert losses[0] == losses[1] and len(losses[0]) == 5


def test_batches_from_the_cache_equal_those_encoded_on_the_fly_and_their_losses_too(make_config, shapes_dataset,
                                                                                  tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    batches, losses = {}, {}
    for cached in (False, True):
        config = in_context_config(make_config, root, training={"batch_size": 2},
                                   precompute={"enabled": cached, "cache_dir": str(tmp_path / "cache"),
                                               "batch_size": 1},
                                   output_dir=str(tmp_path / f"run-{cached}"))
        context = build_trainer(config).set_up()
        batches[cached] = next(context.source.batches(0))
        with torch.no_grad():
            losses[cached] = clip_losses(context, noisy_inputs(context, batches[cached]))
    on_the_fly, from_cache = batches[False], batches[True]
    reference, target = on_the_fly.latents["control_latents"], on_the_fly.latents["latents_mean"]
    # Read at half the size: half the latent grid, the same latent frames.
    assert reference.shape[:3] == target.shape[:3] and reference.shape[3:] == tuple(s // 2 for s in target.shape[3:])
    assert torch.allclose(from_cache.latents["control_latents"], reference, atol=1e-6)
    assert torch.allclose(losses[True], losses[False], atol=1e-6)


def moving_bar(frames: int, fps: float, height: int, width: int) -> np.ndarray:
    """A white bar crossing a dark frame, one pass per second: frame k shows the bar at time k / fps."""
    video = np.full((frames, height, width, 3), 30, np.uint8)
    for k in range(frames):
        left = int(((k / fps) % 1.0) * width * 0.75)
        video[k, :, left: left + width // 4] = 230
    return video


def test_a_reference_of_another_size_and_frame_rate_is_windowed_like_its_clip(make_config, tmp_path):
    """The same scene as 12 fps 40x56 (the clip) and 24 fps 80x112 (its reference): the reference's window shows
    the clip's frames, at the same times and framed alike, at the clip's size over the factor."""
    root = tmp_path / "data"
    root.mkdir()
    write_video(root / "clip.mp4", moving_bar(30, 12.0, 40, 56), fps=12.0)
    write_video(root / "reference.mp4", moving_bar(60, 24.0, 80, 112), fps=24.0)
    (root / "videos.txt").write_text("clip.mp4\n")
    (root / "prompts.txt").write_text("a bar\n")
    (root / "controls.txt").write_text("reference.mp4\n")
    frames, height, width = TINY_SHAPES[FAMILY]
    for fps in (None, 12.0):
        config = in_context_config(make_config, root, data={"fps": fps, "frame_sampling": "random"})
        clips = load_dataset(config.data, progress=False)
        dataset = VideoCaptionDataset(clips, config.data.bucket_shapes(), config.data.fps, frame_sampling="random",
                                      seed=3, control_downscale=control_downscale(config))
        for position in range(3):
            item = dataset[(position, 0, clips[0].bucket or 0)]
            video, reference = item["video"], item["control"]
            assert reference.shape == (frames, 3, height // 2, width // 2)
            smaller = torch.nn.functional.interpolate(video, size=(height // 2, width // 2), mode="area")
            error = (reference - smaller).abs().mean()
            shifted = (reference[1:] - smaller[:-1]).abs().mean()  # one frame off: what a wrong window gives
            assert error < 0.1 and error < 0.5 * shifted, (fps, position, float(error), float(shifted))
    # Given as the clip's `reference` input instead, the reference is read at the same times.
    (root / "references.txt").write_text("reference.mp4\n")
    by_input = in_context_config(make_config, root, data={
        "fps": None, "frame_sampling": "random", "root": None,
        "datasets": [{"type": "pairs", "root": str(root), "controls": "none.txt",
                      "inputs": {"reference": "references.txt"}}]})
    (root / "controls.txt").rename(root / "controls.txt.off")
    clips = with_reference_controls(by_input, load_dataset(by_input.data, progress=False))
    (root / "controls.txt.off").rename(root / "controls.txt")
    assert clips[0].control == root / "reference.mp4"
    listed = VideoCaptionDataset(load_dataset(by_input.data.model_copy(update={"datasets": None, "root": str(root)}),
                                              progress=False), config.data.bucket_shapes(), frame_sampling="random",
                                 seed=3, control_downscale=2)
    given = VideoCaptionDataset(clips, config.data.bucket_shapes(), frame_sampling="random", seed=3,
                                control_downscale=2)
    for position in range(3):
        assert torch.equal(given[(position, 0, 0)]["control"], listed[(position, 0, 0)]["control"])
    # The cache reads the reference at the same times: its latents equal those encoded on the fly.
    references = []
    for cached in (False, True):
        config = in_context_config(make_config, root, precompute={"enabled": cached, "batch_size": 1,
                                                                  "cache_dir": str(tmp_path / "cache")},
                                   output_dir=str(tmp_path / f"run-{cached}"))
        references.append(next(build_trainer(config).set_up().source.batches(0)).latents["control_latents"])
    assert torch.allclose(references[0], references[1], atol=1e-6)


def test_the_memory_planner_may_store_an_in_context_loras_base_smaller(make_config, shapes_dataset, tmp_path):
    from vidtune.memory.suggest import _training_changes

    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    changes = _training_changes(in_context_config(make_config, root))
    assert ["memory.base_weights=nf4"] in changes  # only the adapter trains: the frozen base may be quantized


def test_in_context_training_refuses_what_it_cannot_use(make_config, shapes_dataset, tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    with pytest.raises(ConfigError, match="ltx-video cannot train in context"):
        build_trainer(make_config("ltx-video", data_root=root, training=IN_CONTEXT)).run()
    with pytest.raises(ConfigError, match="ltx-2-i2v samples without an in-context pipeline"):
        build_trainer(make_config("ltx-2-i2v", data_root=root, training=IN_CONTEXT)).run()
    with pytest.raises(ConfigError, match=r"control\.reference_downscale_factor: 3: the clips' size 32x32"):
        build_trainer(in_context_config(make_config, root, factor=3)).run()
    with pytest.raises(DataError, match=r"videos\.txt line 1 \(.*\) has no control clip\.(.|\n)*in-context-lora"):
        build_trainer(in_context_config(make_config, shapes_dataset)).run()


def test_the_lora_records_its_factor_loads_in_the_in_context_pipeline_and_samples_with_control(
        make_config, shapes_dataset, tmp_path, capsys):
    root, _, controls = control_dataset(shapes_dataset, tmp_path / "data")
    config = in_context_config(make_config, root, training={"steps": 2, "learning_rate": 1e-2},
                               lora={"target_modules": "all-linear"})
    build_trainer(config).run()
    run = Path(config.output_dir)
    comfyui = run / comfyui_lora_weights(run.name)
    assert recorded_factor(run / LORA_WEIGHTS) == 2 and recorded_factor(comfyui) == 2
    with safe_open(str(run / LORA_WEIGHTS), framework="pt") as opened:
        assert "lora_adapter_metadata" in opened.metadata() and opened.metadata()[FACTOR_KEY] == "2"
    # The ComfyUI file holds only keys ComfyUI's LTX-2 model reads.
    spec = build_spec(config)
    names = spec.comfyui_model().lora_names()
    modules = {key.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for key in load_file(comfyui)}
    assert modules and modules <= names.keys(), sorted(modules - names.keys())
    trained = load_pipeline(run, device="cpu")
    assert type(trained.pipeline).__name__ == "LTX2InContextPipeline"
    adapted = [name for name, _ in trained.pipeline.transformer.named_modules() if name.endswith("lora_A")]
    assert adapted
    written = sample_run(trained, CONTROL_CAPTION, tmp_path / "sample.mp4", control=controls[1],
                         num_inference_steps=2)
    assert written.is_file() and written.with_suffix(".png").is_file()
    frames, height, width = TINY_SHAPES[FAMILY]
    assert read_clip(written, ClipWindow(frames, height, width)).shape == (frames, 3, height, width)
    # Validation samples through the in-context pipeline, given the first clip's reference and the run's settings.
    weaker = in_context_config(make_config, root, control={"attention_strength": 0.5})
    clips = read_sources(weaker.data).clips
    with build_part(weaker, spec).sampling(trained.pipeline, trained.vae, clips) as bound:
        assert type(bound.pipeline).__name__ == "LTX2InContextPipeline"
        assert bound.inputs["conditioning_attention_strength"] == 0.5
        assert bound.inputs["reference_downscale_factor"] == 2
        given = bound.inputs["reference_conditions"][0].frames
        assert (len(given), given[0].size) == (frames, (width // 2, height // 2))
    # Another run's part exports a checkpoint's weights with the factor recorded too.
    part = build_part(config, spec)
    exported = part.export(load_file(run / LORA_WEIGHTS), tmp_path / "exported")
    assert recorded_factor(exported) == 2


def relative_error(sampled: torch.Tensor, x0: torch.Tensor) -> float:
    return float((sampled - x0).norm() / x0.norm())


@pytest.mark.slow
def test_each_reference_brings_back_its_target_through_the_in_context_pipeline(make_config, shapes_dataset,
                                                                               tmp_path):
    """Two (reference, target) pairs with one caption: sampled through LTX2InContextPipeline, each reference brings
    back its own target, far nearer than the untrained model's sample, and nearer than the other target."""
    root, targets, controls = control_dataset(shapes_dataset, tmp_path / "data")
    steps = 600
    config = in_context_config(
        make_config, root, factor=2, model={"clips_without_sound": "silence", "first_frame_conditioning": 0.0},
        control={"with_audio": True},
        training={"steps": steps, "learning_rate": 1e-2, "batch_size": 4, "max_grad_norm": None,
                  "sigma_sampling": "uniform", "sigma_shift": 1.0},
        lora={"rank": 32, "alpha": 32, "target_modules": "all-linear"},
        optimizer={"weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_steps": steps // 10},
        logging={"progress": False, "log_every": 100})
    started = time.perf_counter()
    build_trainer(config).run()
    trained = load_pipeline(config.output_dir, device="cpu")
    spec = trained.spec
    base = spec.in_context_pipeline(spec.pipeline(spec.load_text_components(CPU), trained.vae,
                                                  spec.load_denoiser(CPU).eval()))
    frames, height, width = TINY_SHAPES[FAMILY]
    x0s = [spec.prepare_latents(trained.vae, read_clip(t, ClipWindow(frames, height, width))[None])["latents_mean"]
           for t in targets]

    def sample(pipeline, control: Path) -> torch.Tensor:
        pipeline.set_progress_bar_config(disable=True)
        reference = read_reference(control, frames, height, width, 2)
        with torch.no_grad():
            return spec.sample(referenced(spec, pipeline, reference, 2, 1.0), CONTROL_CAPTION, frames=frames,
                               height=height, width=width, num_inference_steps=20,
                               generator=torch.Generator().manual_seed(1), output="latents").latents

    for number, control in enumerate(controls):
        after, before = sample(trained.pipeline, control), sample(base, control)
        own, other = relative_error(after, x0s[number]), relative_error(after, x0s[1 - number])
        untrained = relative_error(before, x0s[number])
        print(f"in-context target {number}: relative error {own:.3f} (to the other target {other:.3f}), untrained "
              f"{untrained:.3f} ({time.perf_counter() - started:.0f} s)")
        assert own < 0.3 * untrained and own < 0.5 * other, (number, own, other, untrained)


def test_a_reference_input_trains_like_a_control_clip(make_config, shapes_dataset, tmp_path):
    """The per-clip inputs' `reference` (a references.txt list) is an in-context run's reference where a clip has no
    control clip: its batches equal those of the same clips named in controls.txt."""
    root, _, controls = control_dataset(shapes_dataset, tmp_path / "data")
    (root / "references.txt").write_text("".join(f"{path}\n" for path in controls))
    (root / "controls.txt").unlink()
    by_input = {"root": None, "datasets": [{"type": "pairs", "root": str(root),
                                            "inputs": {"reference": "references.txt"}}]}
    references = []
    for name, data in (("input", by_input), ("controls", None)):
        if data is None:
            (root / "controls.txt").write_text("".join(f"{path}\n" for path in controls))
        config = in_context_config(make_config, root, training={"batch_size": 2}, data=data or {},
                                   output_dir=str(tmp_path / name))
        references.append(next(build_trainer(config).set_up().source.batches(0)).latents["control_latents"])
    assert torch.equal(references[0], references[1])
