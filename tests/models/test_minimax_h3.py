"""MiniMax H3 specifics that must match what its modular pipeline does: the caption's Qwen3-VL hidden state, every
input of the transformer's packed sequence (layout, rotary grid, modality tags, per-row timesteps), the sound's
latents, the joint loss. That both streams overfit one clip and sample back through the pipeline's own blocks is
tests/models/test_overfit.py's run (the tiny model's `OverfitSettings.audio_bound`)."""

from __future__ import annotations

import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

from tests.helpers.datasets import one_clip_dataset, pair_samples
from tests.helpers.runs import overfit_config
from tests.helpers.sound import add_tone
from vidtune.config import ModelConfig, TrainingConfig, build_config
from vidtune.data.audio import AudioBatch
from vidtune.errors import ConfigError, ModelError
from vidtune.models.minimax_h3 import MiniMaxH3Spec, TextOnlyTokenTypes
from vidtune.models.sound import AUDIO_LATENTS, AUDIO_NOISE, AUDIO_PRESENT, AUDIO_SIGMAS
from vidtune.models.tiny.minimax_h3 import SHAPE, tone_waveforms
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
FRAMES, HEIGHT, WIDTH = SHAPE


def _spec(folder, **model) -> MiniMaxH3Spec:
    return MiniMaxH3Spec(ModelConfig(name="minimax-h3", pretrained=str(folder), **model), frame_rate=24.0)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("minimax-h3")


@pytest.fixture(scope="module")
def parts(folder):
    spec = _spec(folder)
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU).eval()


def test_conditions_are_the_pipelines_qwen3_vl_hidden_state(parts):
    spec, text, _, _ = parts
    conditions = spec.prepare_conditions(text, ["a red circle", ""])
    ids = text["tokenizer"]("a red circle", add_special_tokens=False)["input_ids"]
    expected = get_qwen3vl_prompt_embeds(text["text_encoder"], TextOnlyTokenTypes(), ids, {}, text_encoder_layer=50,
                                         device=CPU, dtype=torch.float32)
    rows = int(conditions["prompt_attention_mask"][0].sum())
    assert rows == len(ids) > 0
    torch.testing.assert_close(conditions["prompt_embeds"][:1, :rows], expected)
    assert not conditions["prompt_embeds"][0, rows:].any()  # padding the transformer never reads
    assert int(conditions["prompt_attention_mask"][1].sum()) == 0  # the empty caption: no text row


def test_training_feeds_the_transformer_what_the_pipeline_feeds_it(parts):
    spec, text, vae, denoiser = parts
    seen: list[dict] = []
    hook = denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    try:
        pipeline = spec.pipeline(text, vae, denoiser)
        pipeline.set_progress_bar_config(disable=True)
        sample = spec.sample(pipeline, "a red circle", frames=FRAMES, height=HEIGHT, width=WIDTH,
                             num_inference_steps=2, generator=torch.Generator().manual_seed(0), output="latents")
        assert len(seen) == 2  # guidance-distilled: one forward a step
        from_pipeline = seen[0]
        conditions = spec.prepare_conditions(text, ["a red circle"])
        latents = spec.prepare_latents(vae, torch.zeros(1, FRAMES, 3, HEIGHT, WIDTH))
        conditions[AUDIO_LATENTS] = latents[AUDIO_LATENTS]
        # The pipeline's first step: pure noise for both streams, t = 0 (sigma 1), timestep 0 on vidtune's scale.
        with torch.no_grad():
            spec.forward(denoiser, conditions, torch.randn_like(latents["latents_mean"]), torch.tensor([0.0]))
        from_training = seen[-1]
    finally:
        hook.remove()
    assert sample.latents.shape == latents["latents_mean"].shape
    assert sample.audio_latents.shape == latents[AUDIO_LATENTS].shape
    torch.testing.assert_close(from_training["encoder_hidden_states"], from_pipeline["encoder_hidden_states"])
    for key in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices", "timestep",
                "timestep_indices"):
        torch.testing.assert_close(from_training[key].cpu(), from_pipeline[key].cpu(), msg=key)
    for key in ("hidden_states", "audio_hidden_states"):
        assert from_training[key].shape == from_pipeline[key].shape, key
    assert float(from_pipeline["timestep"].max()) == 0.0  # unscaled t = 1 - sigma


def test_the_objective_is_the_schedulers_data_ward_velocity(parts):
    spec = parts[0]
    objective = spec.objective(TrainingConfig())
    x0, noise, sigma = torch.randn(1, 4), torch.randn(1, 4), torch.tensor([0.25])
    noisy = objective.noisy(x0, noise, sigma)
    scheduler = spec.load_scheduler()
    scheduler.set_timesteps(sigmas=[0.25, 0.0])
    t = objective.timesteps(sigma) / 1000.0
    torch.testing.assert_close(t, 1.0 - sigma)
    # The scheduler's one step to sigma 0 with the target as the prediction lands on the clean sample.
    stepped = scheduler.step(objective.target(x0, noise, sigma), scheduler.timesteps[0], noisy).prev_sample
    torch.testing.assert_close(stepped, x0)


def test_a_clips_sound_becomes_its_audio_latents_and_silence_is_marked_absent(parts):
    spec, _, vae, _ = parts
    seconds = FRAMES / 24.0
    tones = tone_waveforms(seconds)[:2]
    latents = spec.prepare_latents(vae, torch.zeros(2, FRAMES, 3, HEIGHT, WIDTH),
                                   AudioBatch(tones, torch.tensor([True, False])))
    audio, present = latents[AUDIO_LATENTS], latents[AUDIO_PRESENT]
    assert audio.shape == (2, 2, round(seconds * 40), 4)
    assert present.flatten().tolist() == [True, False]
    torch.testing.assert_close(audio[0], spec.sound_latents(vae.audio_vae, tones[:1], FRAMES)[0])
    torch.testing.assert_close(audio[1], spec.sound_latents(vae.audio_vae, torch.zeros_like(tones[:1]), FRAMES)[0])
    assert not torch.allclose(audio[0], audio[1])


def test_the_loss_adds_the_audio_error_of_clips_with_sound_only(parts):
    spec, text, vae, denoiser = parts
    conditions = spec.prepare_conditions(text, ["a red circle", "a red circle"])
    latents = spec.prepare_latents(vae, torch.zeros(2, FRAMES, 3, HEIGHT, WIDTH),
                                   AudioBatch(tone_waveforms(FRAMES / 24.0)[:2], torch.tensor([True, False])))
    objective = spec.objective(TrainingConfig())
    drawn, metrics = spec.stream_noise(objective, latents, [torch.Generator().manual_seed(i) for i in range(2)])
    assert torch.isnan(metrics[AUDIO_SIGMAS][1]) and not torch.isnan(metrics[AUDIO_SIGMAS][0])
    conditions.update({AUDIO_LATENTS: latents[AUDIO_LATENTS], AUDIO_PRESENT: latents[AUDIO_PRESENT], **drawn})
    x0 = latents["latents_mean"]
    noise = torch.randn_like(x0)
    sigmas = torch.tensor([0.5, 0.5])
    noisy, target = objective.noisy(x0, noise, sigmas), objective.target(x0, noise, sigmas)
    timesteps = objective.timesteps(sigmas)
    with torch.no_grad():
        error = spec.training_error(denoiser, conditions, noisy, timesteps, target)
        video, audio, audio_target = spec.joint_forward(denoiser, conditions, noisy, timesteps)
    video_error = (video - target).pow(2).flatten(1).mean(1)
    audio_error = (audio - audio_target).pow(2).flatten(1).mean(1)
    torch.testing.assert_close(error, video_error + torch.tensor([1.0, 0.0]) * audio_error)
    torch.testing.assert_close(audio_target, latents[AUDIO_LATENTS] - conditions[AUDIO_NOISE])


def test_the_audio_noise_level_is_drawn_apart_from_the_videos(parts):
    spec, _, vae, _ = parts
    latents = spec.prepare_latents(vae, torch.zeros(1, FRAMES, 3, HEIGHT, WIDTH))
    objective = spec.objective(TrainingConfig())
    generator = torch.Generator().manual_seed(3)
    video = objective.sample_noise_levels(1, generator)
    drawn, metrics = spec.stream_noise(objective, latents, [generator])
    assert drawn[AUDIO_NOISE].shape == latents[AUDIO_LATENTS].shape
    assert float(drawn[AUDIO_SIGMAS][0]) != float(video[0])
    assert torch.isnan(metrics[AUDIO_SIGMAS]).all()  # the clip has no sound track: no audio level is logged


def test_shapes_outside_the_vae_chunks_and_other_frame_rates_are_refused(folder, tmp_path):
    spec = _spec(folder)
    spec.check_video_shape(FRAMES, HEIGHT, WIDTH)
    with pytest.raises(ConfigError, match=r"data.frames=21 must be 17k\+5.*22"):
        spec.check_video_shape(21, HEIGHT, WIDTH)
    with pytest.raises(ConfigError, match=r"data\.height=48 must be a multiple of 32"):
        spec.check_video_shape(FRAMES, 48, WIDTH)
    with pytest.raises(ConfigError, match=r"data\.width=32 must be at least 64 \(two patch columns\)"):
        spec.check_video_shape(FRAMES, HEIGHT, 32)
    config = build_config({"model": {"name": "minimax-h3", "pretrained": str(folder), "frame_rate": 25.0},
                           "data": {"root": str(tmp_path), "frames": FRAMES, "height": HEIGHT, "width": WIDTH}})
    with pytest.raises(ConfigError, match="24 fps model"):
        spec.check_training(config)


def test_guidance_is_refused_by_the_distilled_pipeline(parts):
    spec, text, vae, denoiser = parts
    pipeline = spec.pipeline(text, vae, denoiser)
    with pytest.raises(ConfigError, match="guidance-distilled"):
        spec.sample(pipeline, "a red circle", frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), guidance_scale=5.0)


def test_a_sample_has_frames_and_a_stereo_sound_track(parts):
    spec, text, vae, denoiser = parts
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    sample = spec.sample(pipeline, "a red circle", frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                         generator=torch.Generator().manual_seed(0))
    assert sample.frames.shape == (FRAMES, 3, HEIGHT, WIDTH)
    assert sample.audio.shape[0] == 2 and sample.sample_rate == vae.audio_vae.config.sampling_rate
    assert sample.audio.shape[1] == pytest.approx(FRAMES / 24.0 * sample.sample_rate, abs=vae.audio_vae.hop_length)


def test_a_run_with_sound_resumes_bitwise(folder, shapes_dataset, tmp_path):
    """A LoRA run on a clip with sound, stopped after its third step and resumed, ends with the adapter of the run
    that was never stopped: the sound's noise levels and noise come back with the clip's generator."""

    from tests.helpers.runs import assert_resume_is_bitwise

    clip = pair_samples(shapes_dataset)[0]
    data_root = one_clip_dataset(clip.video, clip.caption, tmp_path / "data")
    add_tone(data_root / clip.video.name, hz=300.0)

    def config(out, **checkpointing):
        return overfit_config("minimax-h3", folder, data_root, out, training={
            "algorithm": "lora", "steps": 5, "batch_size": 2, "learning_rate": 1e-3},
            checkpoint={"every": 10, "keep": 2, **checkpointing}, optimizer={"warmup_steps": 1})

    assert_resume_is_bitwise(config, tmp_path, 3)


def test_float8_base_weights_are_never_suggested_and_refused_with_the_reason(folder, tmp_path):
    """The transformer casts layers' inputs to their weight dtype: `vidtune plan` offers int8 and nf4, not fp8, and
    fp8 is refused before any long work."""
    from vidtune.memory.suggest import _training_changes

    config = build_config({"model": {"name": "minimax-h3", "pretrained": str(folder)},
                           "data": {"root": str(tmp_path), "frames": FRAMES, "height": HEIGHT, "width": WIDTH},
                           "training": {"algorithm": "lora"}})
    offered = {change for combo in _training_changes(config) for change in combo}
    assert {"memory.base_weights=int8", "memory.base_weights=nf4"} <= offered
    assert "memory.base_weights=fp8" not in offered
    fp8 = config.model_copy(update={"memory": config.memory.model_copy(update={"base_weights": "fp8"})})
    with pytest.raises(ConfigError, match=r"memory\.base_weights=fp8: minimax-h3's transformer casts .* float8"):
        _spec(folder).check_training(fp8)


def test_modes_outside_the_keyframe_workflow_are_refused_naming_it(folder):
    """The keyframe workflow trains (tests/models/test_minimax_h3_keyframes.py): the modes it has no input for are
    refused with the reason, the reference workflow with its own; a run not trained from a first frame does not sample
    from one."""
    from vidtune.config.schema import ConditioningConfig
    from vidtune.models.conditioning import Given

    spec = _spec(folder)
    spec.check_conditioning_modes(ConditioningConfig(last_frame=0.3, first_last=0.3))
    with pytest.raises(ConfigError, match=r"(?s)cannot train extension conditioning: .*keyframe workflow \(`fl2va`"
                                          r".*no clip to extend.*`ref2va`.*transformer_ref"):
        spec.check_conditioning_modes(ConditioningConfig(extension=0.5))
    with pytest.raises(ConfigError, match=r"cannot train inpaint conditioning: .*no mask"):
        spec.check_conditioning_modes(ConditioningConfig(inpaint=0.5))
    with pytest.raises(ModelError, match=r"cannot sample first-frame conditioning: .*`fl2va`"):
        spec.check_given(Given("first_frame", frames=torch.zeros(1, 3, HEIGHT, WIDTH)))
    _spec(folder, first_frame_conditioning=0.5).check_given(Given("first_frame", frames=torch.zeros(1, 3, HEIGHT,
                                                                                                      WIDTH)))


@pytest.mark.parametrize("option", ["int8", "nf4"])
def test_int8_and_nf4_base_weights_train(make_config, option):
    """The frozen transformer stored in int8 or nf4 (what is offered in place of fp8) trains: finite losses."""
    import math

    result = build_trainer(make_config("minimax-h3", memory={"base_weights": option}, training={"steps": 2})).run()
    assert len(result.losses) == 2 and all(math.isfinite(loss) for loss in result.losses)


@pytest.mark.parametrize("frames", [22, 39])
def test_each_latent_frame_names_the_frames_the_vae_encodes_into_it(parts, frames):
    """Chunks of 17 frames, each padded in front to whole groups of 4, the last three latent frames dropped: a
    chunk's first latent frame holds its first frame alone. As many groups as the VAE gives latent frames, and a
    clip changed only in one group's frames changes only that latent frame (and the causal ones after it)."""
    spec, vae = parts[0], parts[2]
    clip = torch.zeros(1, frames, 3, SHAPE[1], SHAPE[2])
    with torch.no_grad():
        base = spec.prepare_latents(vae, clip, audio=None)["latents_mean"]
    groups = spec.latent_frame_groups(frames, base.shape[2])
    assert len(groups) == base.shape[2]
    assert [frame for group in groups for frame in group] == list(range(frames))
    assert groups[:2] == [range(0, 1), range(1, 5)] and groups[5] == range(17, 18)
    for index in (1, 5):  # a chunk's middle group, a second chunk's first frame
        changed = clip.clone()
        changed[:, groups[index].start:groups[index].stop] = 0.5
        with torch.no_grad():
            latents = spec.prepare_latents(vae, changed, audio=None)["latents_mean"]
        differs = (latents - base).abs().amax(dim=(0, 1, 3, 4)) > 1e-6
        assert not differs[:index].any() and differs[index]


def test_a_keyframe_anchor_is_fed_as_the_pipelines_keyframe_workflow_feeds_it(parts):
    """The keyframe workflow's first step with a first image, against training's forward given that image's anchor:
    the anchor's rows lead the video rows (clean latents of the picture encoded alone, noised to t = 0.999 with the
    request's first draw), at the first frame's rotary time, held at t = 0.999 while the clip is at t = 0, and they
    stay out of the prediction. Both are given the same caption rows (the caption's encoding with the picture's
    vision block is not built: docs/models.md)."""
    from PIL import Image

    from vidtune.models.minimax_h3 import KEYFRAME_LATENTS, KEYFRAME_NOISE, keyframe_latents

    spec, text, vae, denoiser = parts
    picture = torch.randint(0, 256, (HEIGHT, WIDTH, 3), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    frame = picture.permute(2, 0, 1).float() / 127.5 - 1.0
    seen: list[dict] = []
    hook = denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    try:
        pipeline = spec.pipeline(text, vae, denoiser)
        pipeline.set_progress_bar_config(disable=True)
        generator = torch.Generator().manual_seed(0)
        result = pipeline(**spec.prompt_inputs(pipeline, "a red circle", 1.0), image=Image.fromarray(picture.numpy()),
                          num_frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=3, generator=generator,
                          output_type="pt", output=["latents"])
        from_pipeline = seen[0]
        conditions = spec.prepare_conditions(text, ["a red circle"])
        latents = spec.prepare_latents(vae, torch.zeros(1, FRAMES, 3, HEIGHT, WIDTH))
        anchor = keyframe_latents(vae.vae, frame[None])
        conditions.update({AUDIO_LATENTS: latents[AUDIO_LATENTS], KEYFRAME_LATENTS: anchor,
                           KEYFRAME_NOISE: torch.randn(anchor.shape, generator=torch.Generator().manual_seed(0))})
        with torch.no_grad():
            prediction = spec.forward(denoiser, conditions, torch.randn_like(latents["latents_mean"]),
                                      torch.tensor([0.0]))
        from_training = seen[-1]
    finally:
        hook.remove()
    assert anchor.shape == (1, *latents["latents_mean"].shape[1:2], 1, *latents["latents_mean"].shape[3:])
    assert prediction.shape == result["latents"].shape == latents["latents_mean"].shape  # no anchor in the output
    anchor_rows = anchor.shape[-2] * anchor.shape[-1] // 4  # (1, 2, 2) patches
    assert from_pipeline["hidden_states"].shape == from_training["hidden_states"].shape
    torch.testing.assert_close(from_training["hidden_states"][:, :anchor_rows],
                               from_pipeline["hidden_states"][:, :anchor_rows])
    torch.testing.assert_close(from_training["encoder_hidden_states"], from_pipeline["encoder_hidden_states"])
    for key in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices", "timestep",
                "timestep_indices"):
        torch.testing.assert_close(from_training[key].cpu(), from_pipeline[key].cpu(), msg=key)
    assert from_pipeline["timestep"].tolist() == pytest.approx([0.0, 0.999])  # the clip at t = 0, the anchor held


def test_a_keyframe_reaches_the_caption_as_the_pipelines_keyframe_text_encoder_presents_it(parts):
    """Sampling from a clip's first frame (an image-to-video spec): the caption's presentation is
    `"<Picture 1>: "`, the frame's Qwen3-VL vision block (tagged as video), then the caption; the caption's rows read
    the picture (they differ from the caption encoded alone), and the transformer reads those rows with the anchor in
    front of the generated ones. A text-to-video spec ignores the reference clip."""
    from vidtune.models.minimax_h3 import KEYFRAME_T

    spec, text, vae, denoiser = parts
    clip = torch.rand(1, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(4)) * 2.0 - 1.0
    keyframe = spec.first_frame_image(clip)
    inputs = spec.keyframe_prompt_inputs(text, "a red circle", keyframe, HEIGHT, WIDTH)
    tokenizer = text["tokenizer"]
    label = len(tokenizer("<Picture 1>: ", add_special_tokens=False)["input_ids"])
    caption = spec.prepare_conditions(text, ["a red circle"])
    caption_rows = int(caption["prompt_attention_mask"][0].sum())
    vision_rows = (HEIGHT // 4) * (WIDTH // 4) // 4 + 2  # patch 4, merged 2 x 2, between vision start and end
    tags = inputs["text_token_tags"]
    assert tags.tolist() == [1] * label + [0] * vision_rows + [1] * caption_rows  # text 1, the vision block video 0
    assert inputs["prompt_embeds"].shape[1] == tags.numel()
    assert not torch.allclose(inputs["prompt_embeds"][0, -caption_rows:], caption["prompt_embeds"][0, :caption_rows])
    seen: list[dict] = []
    hook = denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    keyframed = type("KeyframedMiniMaxH3", (MiniMaxH3Spec,), {"image_to_video": True})(spec.config, frame_rate=24.0)
    try:
        pipeline = keyframed.pipeline(text, vae, denoiser)
        pipeline.set_progress_bar_config(disable=True)
        sample = keyframed.sample(pipeline, "a red circle", frames=FRAMES, height=HEIGHT, width=WIDTH,
                                  num_inference_steps=2, generator=torch.Generator().manual_seed(0), output="latents",
                                  reference=clip)
        assert len(seen) == 2
        spec.sample(pipeline, "a red circle", frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output="latents", reference=clip)
    finally:
        hook.remove()
    first = seen[0]
    torch.testing.assert_close(first["encoder_hidden_states"], inputs["prompt_embeds"])
    assert first["token_tags"][: tags.numel()].tolist() == tags.tolist()
    assert first["timestep"].tolist() == pytest.approx([0.0, KEYFRAME_T])
    assert sample.latents.shape[2] == 7  # the generated frames only
    assert seen[2]["timestep"].tolist() == [0.0]  # text to video ignores the reference clip: no anchor
