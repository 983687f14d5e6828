"""MiniMax H3's keyframe workflow (`fl2va`) in training: a share of the samples (`model.first_frame_conditioning`)
given the clip's first frame as the pipeline takes a keyframe, both as the anchor in front of the generated rows and
in the caption's presentation, which is encoded per caption and clip window (its own cache entry kind)."""

from __future__ import annotations

import shutil

import pytest
import torch

from vidtune.batches import CachedBatches, EncodedBatches
from vidtune.config import ModelConfig
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.models import conditioning
from vidtune.models.minimax_h3 import (
    KEYFRAME_LAST_LATENTS,
    KEYFRAME_LATENTS,
    KEYFRAME_MODES,
    KEYFRAME_NOISE,
    KEYFRAME_PROMPT_EMBEDS,
    KEYFRAME_PROMPT_MASK,
    KEYFRAME_T,
    KEYFRAME_TEXT_TAGS,
    MiniMaxH3Spec,
    presentation_keys,
)
from vidtune.models.sound import AUDIO_LATENTS
from vidtune.models.tiny.minimax_h3 import SHAPE
from vidtune.precompute import encode_clip_captions, precompute
from vidtune.precompute.encode import build_spec, recompute_entry
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
FRAMES, HEIGHT, WIDTH = SHAPE
CAPTION = "a red circle"


def _spec(folder, share: float = 1.0, **modes: float) -> MiniMaxH3Spec:
    config = ModelConfig(name="minimax-h3", pretrained=str(folder), first_frame_conditioning=share,
                         conditioning=modes)
    return MiniMaxH3Spec(config, frame_rate=24.0)


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    """The tiny model, trained in every keyframe mode (a share each)."""
    spec = _spec(tiny_model_dir("minimax-h3"), 0.4, last_frame=0.3, first_last=0.3)
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU).eval()


def _clip(seed: int = 4) -> torch.Tensor:
    """[F, 3, H, W] in [-1, 1] whose frames differ."""
    return torch.rand(FRAMES, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(seed)) * 2.0 - 1.0


@pytest.mark.parametrize("mode", ["first_frame", "last_frame", "first_last"])
def test_training_feeds_the_transformer_what_the_keyframe_workflow_feeds_it(parts, mode):
    """A sample drawn into a keyframe mode, built as training builds it (its latents with the anchors, its caption
    encoded with the mode's keyframes, its drawn mode), against the pipeline's first step given those keyframes (as
    validation and `vidtune sample --image` / `--last-frame` call it): the same caption rows and tags, anchor rows,
    rotary grid (the last frame's anchor at the last latent frame's time), modality tags and per-row timesteps; the
    anchors stay out of the prediction. A sample drawn text-only reads the plain caption and no anchor."""
    from vidtune.given_frames import from_clip

    spec, text, vae, denoiser = parts
    clip = _clip()
    ends = KEYFRAME_MODES[mode]
    seen: list[dict] = []
    hook = denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    try:
        pipeline = spec.pipeline(text, vae, denoiser)
        pipeline.set_progress_bar_config(disable=True)
        given = None if mode == "first_frame" else from_clip(mode, clip, 9)  # the first frame: as `reference`
        sample = spec.sample(pipeline, CAPTION, frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                             generator=torch.Generator().manual_seed(0), output="latents", reference=clip,
                             given=given)
        from_pipeline = seen[0]
        latents = spec.prepare_latents(vae, clip[None])
        (with_frame,) = encode_clip_captions(spec, text, [CAPTION], [clip])
        anchor = latents[KEYFRAME_LATENTS]
        generator = torch.Generator().manual_seed(0)  # the pipeline's first draws noise the anchors, in packed order
        noise = torch.cat([torch.randn(anchor.shape, generator=generator) for _ in ends], dim=2)
        conditions = {**spec.prepare_conditions(text, [CAPTION]), AUDIO_LATENTS: latents[AUDIO_LATENTS],
                      KEYFRAME_LATENTS: anchor, KEYFRAME_LAST_LATENTS: latents[KEYFRAME_LAST_LATENTS],
                      **{key: value[None] for key, value in with_frame.items()},
                      conditioning.MODE: torch.tensor([float(conditioning.code(mode))]), KEYFRAME_NOISE: noise}
        x0 = latents["latents_mean"]
        with torch.no_grad():
            prediction = spec.forward(denoiser, conditions, torch.randn_like(x0), torch.tensor([0.0]))
            from_training = seen[-1]
            spec.forward(denoiser, {**conditions, conditioning.MODE: torch.tensor([float(conditioning.NONE)])},
                         torch.randn_like(x0), torch.tensor([0.0]))
            text_only = seen[-1]
    finally:
        hook.remove()
    assert prediction.shape == sample.latents.shape == x0.shape  # no anchor in the output
    torch.testing.assert_close(from_training["encoder_hidden_states"], from_pipeline["encoder_hidden_states"])
    anchor_rows = len(ends) * anchor.shape[-2] * anchor.shape[-1] // 4  # (1, 2, 2) patches
    assert from_training["hidden_states"].shape == from_pipeline["hidden_states"].shape
    torch.testing.assert_close(from_training["hidden_states"][:, :anchor_rows],
                               from_pipeline["hidden_states"][:, :anchor_rows])
    for key in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices", "timestep",
                "timestep_indices"):
        torch.testing.assert_close(from_training[key].cpu(), from_pipeline[key].cpu(), msg=key)
    assert from_pipeline["timestep"].tolist() == pytest.approx([0.0, KEYFRAME_T])
    label = len(text["tokenizer"]("<Picture 1>: ", add_special_tokens=False)["input_ids"])
    vision_rows = (HEIGHT // 4) * (WIDTH // 4) // 4 + 2  # patch 4, merged 2 x 2, between vision start and end
    tags = from_training["token_tags"][: with_frame[presentation_keys(mode)[1]].sum()].tolist()
    assert tags == ([1] * label + [0] * vision_rows) * len(ends) + [1] * int(conditions["prompt_attention_mask"].sum())
    # Text only: the caption alone, no anchor rows.
    caption_rows = int(conditions["prompt_attention_mask"].sum())
    assert text_only["encoder_hidden_states"].shape[1] == caption_rows
    assert text_only["hidden_states"].shape[1] == from_pipeline["hidden_states"].shape[1] - anchor_rows
    assert text_only["timestep"].tolist() == [0.0]


def test_a_dropped_caption_keeps_the_keyframes_presentation_without_the_caption(parts):
    """Caption dropout in the keyframe workflow: `empty` keeps the label and vision block (what the pipeline's
    keyframe text encoder gives an empty prompt), `zero` zeroes the caption's rows."""
    spec, text, _, _ = parts
    clip = _clip()
    (with_caption,) = encode_clip_captions(spec, text, [CAPTION], [clip])
    (with_empty,) = encode_clip_captions(spec, text, [""], [clip])
    plain = spec.prepare_conditions(text, [CAPTION])
    keyframe = {key: value[None] for key, value in with_caption.items()}
    empty_rows = int(with_empty[KEYFRAME_PROMPT_MASK].sum())
    dropped = {**{key: torch.zeros_like(value) for key, value in plain.items()}, **keyframe}  # `empty`: no rows
    rows, tags = spec.caption_rows(dropped, 0, "first_frame")
    torch.testing.assert_close(rows, with_empty[KEYFRAME_PROMPT_EMBEDS][:empty_rows])
    assert tags.tolist() == with_empty[KEYFRAME_TEXT_TAGS][:empty_rows].tolist()
    zeroed = {**plain, "prompt_embeds": torch.zeros_like(plain["prompt_embeds"]), **keyframe}  # `zero`: mask kept
    rows, _ = spec.caption_rows(zeroed, 0, "first_frame")
    assert rows.shape[0] == int(with_caption[KEYFRAME_PROMPT_MASK].sum()) > empty_rows
    torch.testing.assert_close(rows[:empty_rows], with_empty[KEYFRAME_PROMPT_EMBEDS][:empty_rows])
    assert not rows[empty_rows:].any()
    rows, _ = spec.caption_rows({**plain, **keyframe}, 0, "first_frame")  # kept: the whole presentation
    assert rows[empty_rows:].any()


def test_the_mode_is_a_share_of_the_samples_drawn_per_visit_and_off_by_default(tiny_model_dir):
    folder = tiny_model_dir("minimax-h3")
    x0 = torch.zeros(64, 4, 2, 2, 4)
    positions = torch.arange(64)
    assert _spec(folder, 0.0).visit_conditions(x0, positions, 0) == {}
    assert not _spec(folder, 0.0).reads_clip_in_conditions and not _spec(folder, 0.0).samples_from_image
    drawn = _spec(folder, 0.5).visit_conditions(x0, positions, 0)
    keyframed = drawn[conditioning.MODE] == conditioning.code("first_frame")
    assert 16 < int(keyframed.sum()) < 48 and set(drawn[conditioning.MODE].tolist()) <= {0.0, 1.0}
    assert drawn[KEYFRAME_NOISE].shape == (64, 4, 1, 2, 4)
    again = _spec(folder, 0.5).visit_conditions(x0, positions, 0)  # from the stream positions alone: resumable
    assert torch.equal(again[conditioning.MODE], drawn[conditioning.MODE])
    assert torch.equal(again[KEYFRAME_NOISE], drawn[KEYFRAME_NOISE])


@pytest.fixture
def keyframe_config(make_config, tmp_path):
    """config(**sections) on two clips of this test's own (which it may edit), every sample in one of the keyframe
    workflow's modes, with its cache in tmp_path/cache."""
    data = render_shapes_dataset(tmp_path / "data", num_clips=2, num_frames=FRAMES, height=HEIGHT, width=WIDTH,
                                 fps=24, seed=0)

    def build(**sections):
        precompute = {"enabled": True, "cache_dir": str(tmp_path / "cache"), "batch_size": 1,
                      **sections.pop("precompute", {})}
        model = {"first_frame_conditioning": 0.4, "conditioning": {"last_frame": 0.3, "first_last": 0.3},
                 **sections.pop("model", {})}
        return make_config("minimax-h3", data_root=data, precompute=precompute, model=model, **sections)

    build.data = data
    return build


def test_captions_read_with_their_clip_come_from_the_cache_as_on_the_fly_and_edits_reencode_only_theirs(
        keyframe_config, tmp_path):
    config = keyframe_config()
    first = precompute(config, progress=False)
    assert (first.clip_conditions_computed, first.clip_conditions_reused) == (2, 0)
    assert "captions with their clip: 2 computed, 0 reused" in first.line()
    batches = []
    for enabled in (False, True):
        trainer = build_trainer(keyframe_config(precompute={"enabled": enabled},
                                                output_dir=str(tmp_path / f"run-{enabled}")))
        trainer.set_up()
        source = trainer.context.source
        assert isinstance(source, CachedBatches if enabled else EncodedBatches)
        batches.append(next(source.batches(0)).latents)
    live, cached = batches
    presentations = {presentation_keys(mode)[0] for mode in KEYFRAME_MODES}
    assert live.keys() == cached.keys() and {*presentations, KEYFRAME_LATENTS, KEYFRAME_LAST_LATENTS} <= live.keys()
    for key in live:
        assert torch.equal(live[key], cached[key]), key
    # An entry gone since is computed again, from the same window, when training reads it.
    plan = first.plan
    entry = next(iter(plan.clip_conditions))
    stored = plan.cache.read("clip_conditions", entry)
    plan.cache.remove("clip_conditions", entry)
    again = recompute_entry(config, build_spec(config), plan, "clip_conditions", entry)
    assert again.keys() == stored.keys() and all(torch.equal(again[key], stored[key]) for key in stored)
    assert plan.cache.exists("clip_conditions", entry)

    data = keyframe_config.data
    captions = (data / "prompts.txt").read_text().splitlines()
    (data / "prompts.txt").write_text("\n".join([captions[0] + " at dusk", *captions[1:]]) + "\n")
    edited_caption = precompute(config, progress=False)
    assert (edited_caption.conditions_computed, edited_caption.latents_computed) == (1, 0)
    assert (edited_caption.clip_conditions_computed, edited_caption.clip_conditions_reused) == (1, 1)

    other = render_shapes_dataset(tmp_path / "other", num_clips=3, num_frames=FRAMES, height=HEIGHT, width=WIDTH,
                                  fps=24, seed=0)
    videos = (data / "videos.txt").read_text().splitlines()
    new_clip = other / (other / "videos.txt").read_text().splitlines()[2]
    shutil.copyfile(new_clip, data / videos[1])  # the second clip's content changes (its name stays)
    edited_clip = precompute(config, progress=False)
    assert (edited_clip.conditions_computed, edited_clip.latents_computed) == (0, 1)
    assert (edited_clip.clip_conditions_computed, edited_clip.clip_conditions_reused) == (1, 1)


def test_validation_samples_from_the_first_clips_first_frame_once_the_workflow_is_trained(keyframe_config):
    from vidtune.data.sources import read_sources
    from vidtune.data.video import ClipWindow, read_clip
    from vidtune.given_frames import validation_given
    from vidtune.sampling import SampleSettings, reference_clip

    for share, expected in ((0.0, False), (0.5, True)):
        config = keyframe_config(model={"first_frame_conditioning": share, "conditioning": {}})
        spec = build_spec(config)
        clips = read_sources(config.data).clips
        settings = SampleSettings.from_config(config, spec, default_prompt=CAPTION)
        reference = reference_clip(spec, clips, settings, config.data.fps)
        assert (reference is not None) == expected
        if expected:
            first = read_clip(clips[0].video, ClipWindow(1, settings.height, settings.width, fps=config.data.fps))
            assert torch.equal(reference, first)
    # With the last frame's modes, validation samples the mode of the largest share (both frames here).
    config = keyframe_config(model={"first_frame_conditioning": 0.2, "conditioning": {"first_last": 0.6}})
    given = validation_given(build_spec(config), config, read_sources(config.data).clips, FRAMES, HEIGHT, WIDTH)
    assert given is not None and given.mode == "first_last" and given.last is not None


def test_base_preservation_is_refused_with_the_keyframe_workflow(keyframe_config):
    from vidtune.errors import ConfigError

    config = keyframe_config(training={"preserve_base": {"weight": 1.0, "prompts": ["a shape"]}})
    with pytest.raises(ConfigError, match=r"training\.preserve_base with the keyframe workflow"):
        build_spec(config).check_training(config)


def test_a_run_in_the_keyframe_workflow_resumes_bitwise(keyframe_config, tmp_path):
    """Samples in each keyframe mode and text only: a run stopped after its second step and resumed ends with the
    adapter of the run never stopped (the modes and anchor noise come back with the stream positions)."""

    from tests.helpers.runs import assert_resume_is_bitwise

    def config(out, **checkpointing):
        return keyframe_config(model={"first_frame_conditioning": 0.3, "conditioning": {"last_frame": 0.2,
                                                                                         "first_last": 0.2}},
                               output_dir=str(out),
                               training={"algorithm": "lora", "steps": 4, "batch_size": 2},
                               checkpoint={"every": 10, "keep": 2, **checkpointing})

    seed = config(tmp_path / "reference").training.seed
    spec = _spec(keyframe_config.data, 0.3, last_frame=0.2, first_last=0.2)
    codes = spec.visit_conditions(torch.zeros(8, 4, 2, 2, 4), torch.arange(8), seed)[conditioning.MODE]
    assert len(set(codes.tolist())) >= 3  # the kinds mix within the run
    assert_resume_is_bitwise(config, tmp_path, 2)


def test_step_0_is_the_base_model_and_validation_and_sample_take_the_keyframes(keyframe_config, tmp_path,
                                                                              monkeypatch):
    """A LoRA's first keyframed batch has the base model's loss (a full fine-tune before its first step) exactly;
    validation samples the mode of the largest share from the first clip (its first frame here), and `vidtune sample`
    takes a first frame (--image), a last one (--last-frame), or both, each reaching the keyframe workflow."""
    from PIL import Image

    from vidtune.sampling import load_pipeline, sample_run

    losses = []
    for algorithm in ("lora", "full"):
        trainer = build_trainer(keyframe_config(training={"algorithm": algorithm},
                                                output_dir=str(tmp_path / algorithm)))
        trainer.set_up()
        batch = next(trainer.context.source.batches(0))
        with torch.no_grad():
            losses.append(trainer.context.loss(trainer.context, batch).total)
    assert torch.equal(losses[0], losses[1])

    calls: list[tuple[str | None, bool]] = []
    original = MiniMaxH3Spec.keyframe_prompt_inputs

    def recorded(self, text, prompt, keyframe, height, width, last=None):
        calls.append((keyframe is not None, last is not None))
        return original(self, text, prompt, keyframe, height, width, last)

    monkeypatch.setattr(MiniMaxH3Spec, "keyframe_prompt_inputs", recorded)
    config = keyframe_config(training={"steps": 1}, output_dir=str(tmp_path / "run"),
                             validation={"enabled": True, "every": 1, "num_inference_steps": 2})
    assert build_trainer(config).run().sample_paths
    assert calls == [(True, False)]  # the first frame's mode: the largest share
    run = load_pipeline(config.output_dir, device="cpu")
    frame = tmp_path / "frame.png"
    Image.new("RGB", (WIDTH, HEIGHT), (200, 30, 30)).save(frame)
    for flags in ({"image": frame}, {"last_frame": frame}, {"image": frame, "last_frame": frame}):
        written = sample_run(run, CAPTION, tmp_path / f"{'-'.join(flags)}.mp4", num_inference_steps=2, **flags)
        assert written.is_file() and calls[-1] == ("image" in flags, "last_frame" in flags)
