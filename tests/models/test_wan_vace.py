"""Wan VACE: the control context training builds is the one WanVACEPipeline builds (with masks and reference images
too); the per-stack LoRA presets adapt what they say; each sample's control clip, mask and reference images reach
training on the fly and from the cache alike; bad masks and reference images are named before anything loads; a run
resumes bit for bit; the LoRA samples through WanVACEPipeline; two (control, target) pairs with one caption are told
apart."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.datasets import CONTROL_CAPTION, control_dataset, write_mask
from tests.helpers.runs import run_stopped_at
from vidtune.algorithms.build import build_part, build_spec
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError, DataError
from vidtune.models.registry import get_spec_class
from vidtune.models.spec import CONTROL_INPUT, CONTROL_LATENTS, POSTERIOR_KEYS, frames_to_pil
from vidtune.models.tiny import TINY_SHAPES
from vidtune.models.wan_vace import FOLDED_MASK, INACTIVE_LATENTS, MASKED_CONTROL, REFERENCE_LATENTS
from vidtune.sampling import load_pipeline
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
FAMILY = "wan-vace"
FRAMES, HEIGHT, WIDTH = TINY_SHAPES[FAMILY]


def _spec(make_config, **sections):
    config = make_config(FAMILY, **sections)
    return config, get_spec_class(FAMILY)(config.model, frame_rate=config.frame_rate)


def _on_uint8_grid(videos: torch.Tensor) -> torch.Tensor:
    """Clips whose values a picture holds exactly (what a decoded clip is), so the pipeline's pictures are them."""
    return (videos * 127.5 + 127.5).round() / 127.5 - 1


def test_the_control_context_is_the_pipelines(make_config):
    """What `forward` hands the transformer as `control_hidden_states` equals what WanVACEPipeline computes from the
    same control video (prepare_video_latents with its all-white mask, then prepare_masks), to float precision."""
    _, spec = _spec(make_config)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    generator = torch.Generator().manual_seed(0)
    videos = _on_uint8_grid(torch.rand(2, FRAMES, 3, HEIGHT, WIDTH, generator=generator) * 2 - 1)
    controls = _on_uint8_grid(torch.rand(2, FRAMES, 3, HEIGHT, WIDTH, generator=generator) * 2 - 1)
    latents = spec.prepare_latents(vae, videos)
    conditions = {INACTIVE_LATENTS: latents[INACTIVE_LATENTS],
                  CONTROL_LATENTS: spec.prepare_latents(vae, controls)["latents_mean"]}
    ours = spec.control_context(conditions, latents["latents_mean"])
    pipeline = spec.pipeline(text, vae, denoiser)
    for index in range(2):
        video, mask, references = pipeline.preprocess_conditions(frames_to_pil(controls[index]), None, None, 1,
                                                                  HEIGHT, WIDTH, FRAMES, torch.float32, CPU)
        theirs = torch.cat([pipeline.prepare_video_latents(video, mask, references, None, CPU),
                            pipeline.prepare_masks(mask, references, None)], dim=1)
        assert ours[index : index + 1].shape == theirs.shape
        assert torch.allclose(ours[index : index + 1], theirs, atol=1e-5), (ours[index] - theirs[0]).abs().max()
    # Without a control clip, the pipeline's own default: a black control video (the inactive latents twice).
    bare = spec.control_context({INACTIVE_LATENTS: latents[INACTIVE_LATENTS]}, latents["latents_mean"])
    channels = latents["latents_mean"].shape[1]
    assert torch.equal(bare[:, channels : 2 * channels], latents[INACTIVE_LATENTS])


def test_a_masked_control_with_reference_images_is_the_pipelines(make_config):
    """With a mask and two reference images, the context training builds (`encode_inputs` then `control_context`)
    equals WanVACEPipeline's from the same tensors: the control video split by the binarised mask, the mask folded,
    each reference image encoded alone and put in front (the last first) with zero reactive latents and a zero mask.
    A still mask is the same mask on every frame. The clean latents start with the references' latents, as the
    pipeline's latents start with their positions."""
    _, spec = _spec(make_config)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    generator = torch.Generator().manual_seed(0)
    video = _on_uint8_grid(torch.rand(1, FRAMES, 3, HEIGHT, WIDTH, generator=generator) * 2 - 1)
    control = _on_uint8_grid(torch.rand(FRAMES, 3, HEIGHT, WIDTH, generator=generator) * 2 - 1)
    mask = -torch.ones(FRAMES, 3, HEIGHT, WIDTH)
    mask[:, :, :, WIDTH // 4 :] = 1.0  # white (generate) on the right three quarters
    mask[FRAMES // 2 :, :, : HEIGHT // 2] = 1.0  # and the top half from the middle frame on
    images = [_on_uint8_grid(torch.rand(3, 1, HEIGHT, WIDTH, generator=generator) * 2 - 1) for _ in range(2)]
    latents = spec.prepare_latents(vae, video)
    encoded = spec.encode_inputs(vae, {"mask": mask.transpose(0, 1)[None], "reference_images": [images],
                                       CONTROL_INPUT: control.transpose(0, 1)[None]}, latents)
    assert encoded.keys() >= {MASKED_CONTROL, FOLDED_MASK, REFERENCE_LATENTS}
    trained = spec.training_latents({**latents, **encoded})
    assert trained["latents_mean"].shape[2] == latents["latents_mean"].shape[2] + 2
    ours = spec.control_context(trained, trained["latents_mean"])
    pipeline = spec.pipeline(text, vae, denoiser)
    pictures = [frames_to_pil(image.transpose(0, 1))[0] for image in images]
    pixels, masks, references = pipeline.preprocess_conditions(frames_to_pil(control), frames_to_pil(mask), pictures,
                                                                1, HEIGHT, WIDTH, FRAMES, torch.float32, CPU)
    theirs = torch.cat([pipeline.prepare_video_latents(pixels, masks, references, None, CPU),
                        pipeline.prepare_masks(masks, references, None)], dim=1)
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    # The clean latents' reference positions are the references' own latents, in the context's order.
    channels = latents["latents_mean"].shape[1]
    assert torch.equal(trained["latents_mean"][:, :, :2], ours[:, :channels, :2])
    assert torch.equal(trained["latents_std"][:, :, :2], torch.zeros_like(trained["latents_std"][:, :, :2]))
    # A still: the mask of its one frame on every frame.
    still = spec.encode_inputs(vae, {"mask": mask[:1].transpose(0, 1)[None],
                                     CONTROL_INPUT: control.transpose(0, 1)[None]}, latents)
    every = spec.encode_inputs(vae, {"mask": mask[:1].expand(FRAMES, -1, -1, -1).transpose(0, 1)[None],
                                     CONTROL_INPUT: control.transpose(0, 1)[None]}, latents)
    assert all(torch.equal(still[key], every[key]) for key in (MASKED_CONTROL, FOLDED_MASK))
    # Sampling hands the same mask and pictures to the pipeline: `sample(inputs=...)` is the pipeline's own call
    # with `video`, `mask` and `reference_images`, and (once the VACE branch holds weights) the mask matters.
    with torch.no_grad():
        for block in denoiser.vace_blocks:
            for projection in (block.proj_in, block.proj_out):
                if projection is not None:
                    projection.weight.normal_(0, 0.2, generator=generator)
    pipeline.set_progress_bar_config(disable=True)
    inputs = {"mask": mask.transpose(0, 1), "reference_images": torch.cat(images, dim=1)}

    def sampled(given: dict) -> torch.Tensor:
        return spec.sample(pipeline, CONTROL_CAPTION, frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                           generator=torch.Generator().manual_seed(0), reference=control, inputs=given,
                           output="latents").latents

    direct = pipeline(prompt_embeds=spec.prepare_conditions(text, [CONTROL_CAPTION])["prompt_embeds"],
                      guidance_scale=1.0, video=frames_to_pil(control), mask=frames_to_pil(mask),
                      reference_images=pictures, num_frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                      generator=torch.Generator().manual_seed(0), output_type="latent").frames
    ours_sampled = sampled(inputs)
    assert ours_sampled.shape[2] == latents["latents_mean"].shape[2] + 2
    assert torch.allclose(ours_sampled, direct, atol=1e-5)
    assert not torch.allclose(ours_sampled, sampled({"reference_images": inputs["reference_images"]}), atol=1e-4)


def test_the_control_clip_reaches_the_prediction_once_the_branch_trains(make_config):
    """The tiny model's VACE branch starts as VACE's training starts it (zero input / output projections): its hints
    add nothing, whatever the control. Once those projections hold weights, the control latents reach the
    transformer's output through the VACE blocks: another control, another prediction."""
    _, spec = _spec(make_config)
    vae, denoiser = spec.load_vae(CPU), spec.load_denoiser(CPU).eval()
    generator = torch.Generator().manual_seed(0)
    videos = torch.rand(3, 1, FRAMES, 3, HEIGHT, WIDTH, generator=generator) * 2 - 1
    target, first, second = (spec.prepare_latents(vae, video) for video in videos)
    text = spec.prepare_conditions(spec.load_text_components(CPU), [CONTROL_CAPTION])
    noisy = torch.randn(target["latents_mean"].shape, generator=generator)
    timesteps = torch.tensor([500.0])

    def predictions() -> list[torch.Tensor]:
        with torch.no_grad():
            return [spec.forward(denoiser, {**text, INACTIVE_LATENTS: target[INACTIVE_LATENTS],
                                            CONTROL_LATENTS: control["latents_mean"]}, noisy, timesteps)
                    for control in (first, second)]

    untrained = predictions()
    assert torch.equal(untrained[0], untrained[1])
    with torch.no_grad():
        for block in denoiser.vace_blocks:
            for projection in (block.proj_in, block.proj_out):
                if projection is not None:
                    projection.weight.normal_(0, 0.2, generator=generator)
    trained = predictions()
    assert (trained[0] - trained[1]).abs().max() > 1e-3


def _lora_names(make_config, preset: str) -> list[str]:
    """The modules the run's adapter wraps with `lora.target_modules: preset`."""
    config = make_config(FAMILY, lora={"rank": 2, "alpha": 2, "target_modules": preset})
    spec = build_spec(config)
    denoiser = spec.load_denoiser(CPU)
    build_part(config, spec).configure(denoiser)
    return sorted({key.split(".lora_")[0] for key in denoiser.state_dict() if ".lora_A." in key})


def test_each_stack_has_its_preset(make_config):
    """`main-blocks` adapts the main blocks only, `vace-blocks` the VACE blocks only (with their projections); the
    shared presets adapt both stacks."""
    main = _lora_names(make_config, "main-blocks")
    vace = _lora_names(make_config, "vace-blocks")
    attention = _lora_names(make_config, "attention")
    assert main and all(name.startswith("blocks.") for name in main)
    assert any(name.endswith("ffn.net.2") for name in main)
    assert vace and all(name.startswith("vace_blocks.") for name in vace)
    assert {"vace_blocks.0.proj_in", "vace_blocks.0.proj_out", "vace_blocks.1.proj_out"} <= set(vace)
    assert any(name.startswith("blocks.") for name in attention)
    assert any(name.startswith("vace_blocks.") for name in attention)


def test_a_sample_without_a_control_clip_is_named_before_anything_loads(make_config, shapes_dataset, tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    (root / "controls.txt").unlink()  # a dataset without control clips: every sample is named
    listed = r"2 problems.*\n.*line 1 .*has no control clip\.\n.*line 2 .*\n.*a `controls\.txt` beside"
    with pytest.raises(DataError, match=listed):
        build_trainer(make_config(FAMILY, data_root=root)).run()


def test_a_widened_control_input_is_refused(make_config):
    with pytest.raises(ConfigError, match=r"training.algorithm=control-lora: wan-vace follows its control clip"):
        build_trainer(make_config(FAMILY, training={"algorithm": "control-lora"})).run()


def test_cached_batches_equal_those_encoded_on_the_fly(make_config, shapes_dataset, tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    batches = {}
    for cached in (False, True):
        config = make_config(FAMILY, data_root=root, training={"batch_size": 2},
                             precompute={"enabled": cached, "cache_dir": str(tmp_path / "cache"), "batch_size": 1},
                             output_dir=str(tmp_path / f"run-{cached}"))
        batches[cached] = next(build_trainer(config).set_up().source.batches(0))
    on_the_fly, from_cache = batches[False], batches[True]
    assert torch.equal(on_the_fly.indices, from_cache.indices)
    assert on_the_fly.latents.keys() == from_cache.latents.keys() >= {CONTROL_LATENTS, INACTIVE_LATENTS}
    for key, value in on_the_fly.latents.items():
        assert torch.allclose(from_cache.latents[key], value, atol=1e-6), key
    # The control latents are the control clips', not the targets'.
    assert not torch.allclose(on_the_fly.latents[CONTROL_LATENTS], on_the_fly.latents[POSTERIOR_KEYS[0]], atol=1e-2)


def _reference_image(path: Path, height: int, width: int, seed: int) -> Path:
    from PIL import Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


def _vace_dataset(shapes_dataset: Path, root: Path) -> dict:
    """The two (control, target) pairs with a mask each (a still; the second's white on its right half) and two
    reference images each (the second of another aspect), from masks.txt and references.txt."""
    root, _, _ = control_dataset(shapes_dataset, root)
    masks = [write_mask(root / "mask0.png", 48, 48, white=(0.0, 0.0, 1.0, 0.5)),
             write_mask(root / "mask1.png", 48, 48, white=(0.5, 0.0, 1.0, 1.0))]
    references = [[_reference_image(root / f"ref{clip}{number}.png", 48, 48 - 16 * number, 2 * clip + number)
                   for number in range(2)] for clip in range(2)]
    (root / "masks.txt").write_text("".join(f"{mask.name}\n" for mask in masks))
    (root / "references.txt").write_text("".join(" | ".join(path.name for path in refs) + "\n" for refs in references))
    return {"type": "pairs", "root": str(root), "inputs": {"mask": "masks.txt", "reference_images": "references.txt"}}


def test_masks_and_reference_images_train_alike_from_the_cache_and_on_the_fly(make_config, shapes_dataset, tmp_path,
                                                                                monkeypatch):
    """Each clip's mask and reference images (masks.txt, references.txt) reach training encoded as the pipeline
    encodes them, alike on the fly and from the cache (the same batches and losses); validation hands the first
    clip's mask and reference images to the pipeline; the mask changes what is trained; a changed mask is encoded
    again alone."""
    entry = _vace_dataset(shapes_dataset, tmp_path / "data")
    batches, losses, adapters, configs = {}, {}, {}, {}
    seen: list = []
    original = get_spec_class(FAMILY).sample

    def recording(spec, *args, **kwargs):
        seen.append(kwargs.get("inputs"))
        return original(spec, *args, **kwargs)

    monkeypatch.setattr(get_spec_class(FAMILY), "sample", recording)
    runs = {"on the fly": (entry, False), "cached": (entry, True),
            "without masks": ({**entry, "inputs": {"reference_images": "references.txt"}}, False)}
    for name, (source, cached) in runs.items():
        output = tmp_path / name.replace(" ", "-")
        config = make_config(FAMILY, data={"root": None, "datasets": [source]},
                             training={"batch_size": 2, "steps": 2, "learning_rate": 5e-2},
                             lora={"rank": 4, "alpha": 4, "target_modules": "vace-blocks"},
                             precompute={"enabled": cached, "cache_dir": str(tmp_path / "cache"), "batch_size": 1},
                             validation={"enabled": name == "on the fly", "every": 2, "num_inference_steps": 1},
                             logging={"progress": False, "log_every": 1}, output_dir=str(output))
        trainer, configs[name] = build_trainer(config), config
        batches[name] = next(trainer.set_up().source.batches(0))
        trainer.run()
        losses[name] = [json.loads(row)["loss"] for row in (output / "metrics.jsonl").read_text().splitlines()
                        if "loss" in json.loads(row)]
        adapters[name] = load_file(output / "pytorch_lora_weights.safetensors")
    on_the_fly, from_cache = batches["on the fly"], batches["cached"]
    assert on_the_fly.latents.keys() == from_cache.latents.keys() >= {MASKED_CONTROL, FOLDED_MASK, REFERENCE_LATENTS}
    for key, value in on_the_fly.latents.items():
        assert torch.allclose(from_cache.latents[key], value, atol=1e-6), key
    assert len(losses["on the fly"]) == 2 and losses["cached"] == pytest.approx(losses["on the fly"], rel=1e-5)
    # Two reference latent frames each; the second clip's mask keeps its left half (zero in the folded mask)
    assert on_the_fly.latents[REFERENCE_LATENTS].shape[2] == 2
    second = on_the_fly.indices.tolist().index(1)
    folded = on_the_fly.latents[FOLDED_MASK][second]
    # (resized with its clip, the mask's edge turns a little grey)
    assert folded[..., : folded.shape[-1] // 2].max() < 0.1 and folded[..., folded.shape[-1] // 2 :].min() > 0.9
    # The mask changes what the VACE blocks learn.
    without = adapters["without masks"]
    assert any(not torch.equal(value, without[key]) for key, value in adapters["on the fly"].items())
    # Validation sampled with the first clip's mask (a still) and its two reference images fitted to the shape.
    assert seen and all(inputs is not None and set(inputs) == {"mask", "reference_images"} for inputs in seen)
    assert tuple(seen[0]["mask"].shape) == (3, 1, HEIGHT, WIDTH)
    assert tuple(seen[0]["reference_images"].shape) == (3, 2, HEIGHT, WIDTH)
    # Changing one mask encodes that mask again, alone.
    from vidtune.precompute import precompute

    write_mask(Path(entry["root"]) / "mask1.png", 48, 48, white=(0.0, 0.5, 1.0, 1.0))
    summary = precompute(configs["cached"], progress=False)
    assert (summary.latents_computed, summary.inputs_computed) == (0, 1)


def test_bad_masks_and_reference_images_are_named_before_anything_loads(make_config, shapes_dataset, tmp_path):
    entry = _vace_dataset(shapes_dataset, tmp_path / "data")
    root = Path(entry["root"])
    write_mask(root / "mask1.png", 48, 24)  # another aspect than its clip's
    (root / "ref01.png").write_bytes(b"not a picture")
    config = make_config(FAMILY, data={"root": None, "datasets": [entry]})
    with pytest.raises(DataError) as raised:
        build_trainer(config).run()
    message = str(raised.value)
    assert "videos.txt line 1" in message and "ref01.png cannot be read" in message
    assert "videos.txt line 2" in message and "mask1.png is 48x24, another shape than the clip's" in message


def test_wan_2_2_vace_fun_trains_both_experts_and_samples_through_wan_vace_pipeline(make_config, shapes_dataset,
                                                                                     tmp_path):
    """A Wan 2.2 VACE-Fun A14B folder (two experts and a boundary in model_index.json) is the same family: each
    expert gets its adapter, with masks and reference images, and both load into WanVACEPipeline's `transformer` and
    `transformer_2`; a 5B layout (per-token timesteps) is refused by name before anything loads."""
    from vidtune.models.tiny.wan_vace import write_tiny_wan_vace

    folder = write_tiny_wan_vace(tmp_path / "a14b", two_experts=True, boundary_ratio=0.5)
    entry = _vace_dataset(shapes_dataset, tmp_path / "data")
    config = make_config(FAMILY, model={"pretrained": str(folder)}, data={"root": None, "datasets": [entry]},
                         training={"batch_size": 2, "steps": 2, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4})
    trainer = build_trainer(config)
    trainer.run()
    spec = trainer.spec
    assert spec.two_experts and set(spec.denoiser_parts(trainer.context.denoiser)) == {"transformer", "transformer_2"}
    output = Path(config.output_dir)
    assert {"pytorch_lora_weights.safetensors", "pytorch_lora_weights_transformer_2.safetensors"} <= \
        {path.name for path in output.iterdir()}
    clip = trainer.context.clips[0]
    window = ClipWindow(FRAMES, HEIGHT, WIDTH)
    inputs = {"mask": read_clip(clip.inputs["mask"][0], ClipWindow(1, HEIGHT, WIDTH)).transpose(0, 1),
              "reference_images": torch.cat([read_clip(path, ClipWindow(1, HEIGHT, WIDTH, resize="fit"))
                                             for path in clip.inputs["reference_images"]]).transpose(0, 1)}

    def sample(pipeline) -> torch.Tensor:
        pipeline.set_progress_bar_config(disable=True)
        return spec.sample(pipeline, CONTROL_CAPTION, frames=FRAMES, height=HEIGHT, width=WIDTH,
                           num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                           reference=read_clip(clip.control, window), inputs=inputs, output="latents").latents

    text, vae = spec.load_text_components(CPU), spec.load_vae(CPU)
    plain = spec.pipeline(text, vae, spec.load_denoiser(CPU))
    assert plain.transformer_2 is not None and plain.config.boundary_ratio == 0.5
    adapted = spec.pipeline(text, vae, spec.load_denoiser(CPU))
    spec.load_lora(adapted, output)
    before, after = sample(plain), sample(adapted)
    assert before.shape[2] == (FRAMES - 1) // 4 + 1 + 2  # the two reference images' positions first
    assert (after - before).abs().max() > 1e-4
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    with pytest.raises(ConfigError, match=r"expand_timesteps .*no 5B VACE model loads"):
        build_trainer(config.model_copy(update={"output_dir": str(tmp_path / "refused")})).run()


def test_a_resumed_run_ends_bit_for_bit_like_one_left_alone(make_config, shapes_dataset, tmp_path):
    """With control clips, masks and reference images."""
    entry = _vace_dataset(shapes_dataset, tmp_path / "data")
    settings = {"data": {"root": None, "datasets": [entry]},
                "training": {"steps": 5, "learning_rate": 1e-2, "ema_decay": 0.8}, "checkpoint": {"every": 2},
                "lora": {"dropout": 0.1, "target_modules": "vace-blocks"}}
    build_trainer(make_config(FAMILY, **settings, output_dir=str(tmp_path / "reference"))).run()
    stopped = tmp_path / "stopped"
    run_stopped_at(build_trainer(make_config(FAMILY, **settings, output_dir=str(stopped))), 3)
    resumed = {**settings, "checkpoint": {**settings["checkpoint"], "resume": "latest"}}
    assert build_trainer(make_config(FAMILY, **resumed, output_dir=str(stopped))).run().final_step == 5
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"):
        expected, got = load_file(tmp_path / "reference" / name), load_file(stopped / name)
        assert expected and expected.keys() == got.keys()
        assert all(torch.equal(expected[key], got[key]) for key in expected), name
    losses = [[json.loads(row)["loss"] for row in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (tmp_path / "reference", stopped)]
    assert losses[0] == losses[1] and len(losses[0]) == 5


def _sampled(spec, pipeline, vae, target: Path, control: Path, steps: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target clip's latents, what WanVACEPipeline samples following `control`)."""
    window = ClipWindow(FRAMES, HEIGHT, WIDTH)
    x0 = spec.prepare_latents(vae, read_clip(target, window)[None])["latents_mean"]
    with torch.no_grad():
        sampled = spec.sample(pipeline, CONTROL_CAPTION, frames=FRAMES, height=HEIGHT, width=WIDTH,
                              num_inference_steps=steps, generator=torch.Generator().manual_seed(1),
                              reference=read_clip(control, window), output="latents").latents
    return x0, sampled


def relative_error(sampled: torch.Tensor, x0: torch.Tensor) -> float:
    return float((sampled - x0).norm() / x0.norm())


@pytest.mark.slow
def test_each_control_clip_brings_back_its_target(make_config, shapes_dataset, tmp_path):
    """Two (control, target) pairs with one caption, a LoRA on both stacks: sampled through WanVACEPipeline with
    each control video, each target comes back, nearer its own target than the other's and well below the untrained
    model's error; the step-0 adapter samples exactly what the base model does."""
    root, targets, controls = control_dataset(shapes_dataset, tmp_path / "data")
    steps = 750
    config = make_config(FAMILY, data_root=root,
                         training={"algorithm": "full", "steps": steps, "learning_rate": 6e-3, "batch_size": 8,
                                   "max_grad_norm": None, "sigma_sampling": "uniform", "sigma_shift": 1.0},
                         optimizer={"weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_steps": steps // 10},
                         logging={"progress": False, "log_every": 100})
    started = time.perf_counter()
    build_trainer(config).run()
    trained = load_pipeline(config.output_dir, device="cpu")
    trained.pipeline.set_progress_bar_config(disable=True)
    spec = get_spec_class(FAMILY)(config.model, frame_rate=config.frame_rate)
    base = spec.pipeline(spec.load_text_components(CPU), trained.vae, spec.load_denoiser(CPU).eval())
    base.set_progress_bar_config(disable=True)
    sampled = {}
    for name, target, control in (("A", targets[0], controls[0]), ("B", targets[1], controls[1])):
        x0, after = _sampled(spec, trained.pipeline, trained.vae, target, control)
        _, before = _sampled(spec, base, trained.vae, target, control)
        sampled[name] = (x0, after)
        error, untrained = relative_error(after, x0), relative_error(before, x0)
        print(f"{FAMILY}: target {name}: relative error {error:.3f}, untrained {untrained:.3f} "
              f"({time.perf_counter() - started:.0f} s)")
        assert error < 0.3 * untrained, f"target {name}: {error:.3f} vs untrained {untrained:.3f}"
    (x0_a, after_a), (x0_b, after_b) = sampled["A"], sampled["B"]
    assert relative_error(after_a, x0_a) < relative_error(after_a, x0_b)
    assert relative_error(after_b, x0_b) < relative_error(after_b, x0_a)


def test_the_lora_loads_in_wan_vace_pipeline_and_starts_from_the_base_model(make_config, tmp_path):
    """The adapter file loads with WanVACEPipeline.load_lora_weights; at step 0 (lora_B zero) it samples exactly what
    the base model samples, after training it samples something else; validation follows the first control clip."""
    config = make_config(FAMILY, training={"steps": 2, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4},
                         validation={"enabled": True, "every": 2, "num_inference_steps": 2})
    trainer = build_trainer(config)
    trainer.run()
    spec = trainer.spec
    control = read_clip(trainer.context.clips[0].control, ClipWindow(FRAMES, HEIGHT, WIDTH))
    assert trainer.context.clips[0].control is not None
    assert list((Path(config.output_dir) / "samples").glob("*.mp4")), "validation wrote no sample"

    def sample(pipeline) -> torch.Tensor:
        pipeline.set_progress_bar_config(disable=True)
        return spec.sample(pipeline, CONTROL_CAPTION, frames=FRAMES, height=HEIGHT, width=WIDTH,
                           num_inference_steps=2, generator=torch.Generator().manual_seed(0), reference=control,
                           output="latents").latents

    text, vae = spec.load_text_components(CPU), spec.load_vae(CPU)
    plain = sample(spec.pipeline(text, vae, spec.load_denoiser(CPU)))
    # Step 0: the same adapter with lora_B zero, as training starts.
    untrained = spec.pipeline(text, vae, spec.load_denoiser(CPU))
    weights = load_file(Path(config.output_dir) / "pytorch_lora_weights.safetensors")
    zeroed = {key: torch.zeros_like(value) if "lora_B" in key else value for key, value in weights.items()}
    untrained.load_lora_weights(zeroed)
    assert torch.equal(sample(untrained), plain)
    adapted = spec.pipeline(text, vae, spec.load_denoiser(CPU))
    adapted.load_lora_weights(config.output_dir)
    assert (sample(adapted) - plain).abs().max() > 1e-4


def test_vidtune_sample_follows_the_control_clip_it_is_given(make_config, shapes_dataset, tmp_path, capsys):
    from vidtune.cli import main as cli_main

    """With the run's first sample's mask and reference images (its samples' latents start with the two references'
    positions), whichever control clip it follows."""
    entry = _vace_dataset(shapes_dataset, tmp_path / "data")
    controls = [Path(line) for line in (Path(entry["root"]) / "controls.txt").read_text().splitlines()]
    config = make_config(FAMILY, data={"root": None, "datasets": [entry]}, training={"steps": 2, "learning_rate": 0.1},
                         lora={"rank": 4, "alpha": 4, "target_modules": "vace-blocks"})
    build_trainer(config).run()
    latents = []
    for number, control in enumerate([controls[0], controls[1], None]):
        extra = ["--control", str(control)] if control else []
        output, path = tmp_path / f"s{number}.mp4", tmp_path / f"s{number}.safetensors"
        assert cli_main(["sample", config.output_dir, "--prompt", CONTROL_CAPTION, "--steps", "2", "--device", "cpu",
                         "--output", str(output), "--latents", str(path), *extra]) == 0
        assert output.is_file()
        latents.append(load_file(path)["latents"])
    out = capsys.readouterr().out
    assert "Following the control clip" in out  # without --control: the first clip's
    assert "Following the mask and reference images of the run's first clip" in out
    assert latents[0].shape[2] == (FRAMES - 1) // 4 + 1 + 2
    assert not torch.equal(latents[0], latents[1])  # another control clip, another sample
    assert torch.equal(latents[0], latents[2])
    assert cli_main(["sample", config.output_dir, "--prompt", "x", "--control", str(tmp_path / "no.mp4"),
                     "--device", "cpu"]) == 2
    assert "--control: " in capsys.readouterr().err
