"""`training.masked_loss`: each clip's error weighted by its mask on the latent grid, normalised by the mask's area."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.datasets import masked_dataset
from tests.helpers.runs import run_stopped_at
from vidtune.config import build_config
from vidtune.errors import ConfigError, DataError
from vidtune.models.spec import LOSS_MASK, LOSS_MASK_BY_FRAME
from vidtune.models.tiny import TINY_SHAPES
from vidtune.precompute.encode import build_spec
from vidtune.trainers import build_trainer

LEFT_HALF = (0.0, 0.0, 0.5, 1.0)


def _entry(root, **options):
    return {"type": "pairs", "root": str(root), **options}


def _config(make_config, root, family="ltx-video", masked=True, entry=None, **sections):
    entry = entry or _entry(root, inputs={"mask": "masks.txt"})
    data = {"root": None, "datasets": [entry], **sections.pop("data", {})}
    training = {"masked_loss": masked, "steps": 3, **sections.pop("training", {})}
    return make_config(family, data=data, training=training, **sections)


@pytest.mark.parametrize("family", ["ltx-video", "ltx-video-i2v", "ltx-2"])
def test_an_all_white_mask_gives_exactly_the_plain_loss(make_config, shapes_dataset, tmp_path, family):
    """ltx-video-i2v leaves given first frames out of the loss, ltx-2 adds its audio's error: both keep their own
    rule, and a white mask changes nothing, bit for bit."""
    root = masked_dataset(shapes_dataset, tmp_path / "white")
    masked = build_trainer(_config(make_config, root, family, output_dir=str(tmp_path / "masked"))).run().losses
    plain = build_trainer(_config(make_config, root, family, masked=False,
                                  output_dir=str(tmp_path / "plain"))).run().losses
    assert masked == plain


def test_a_half_black_mask_gives_its_half_no_gradient(make_config, shapes_dataset, tmp_path):
    """The loss's gradient with respect to the denoiser's prediction is zero over the black half of the latent grid
    (the error there does not move the LoRA), and not over the white half; the loss is the white half's mean."""
    trainer = build_trainer(_config(make_config, shapes_dataset, entry=_entry(shapes_dataset, mask_rect=LEFT_HALF)))
    trainer.set_up()
    context = trainer.context
    spec = context.spec
    predictions: list[torch.Tensor] = []
    forward = spec.forward

    def keeping(*args, **kwargs):
        prediction = forward(*args, **kwargs)
        prediction.retain_grad()
        predictions.append(prediction)
        return prediction

    spec.forward = keeping
    batch = next(context.source.batches(0))
    mask = batch.latents["input_mask"]
    width = mask.shape[-1]
    assert torch.all(mask[..., : width // 2] == 1.0) and torch.all(mask[..., width // 2 :] == 0.0)
    context.loss(context, batch).total.backward()
    (prediction,) = predictions
    assert torch.all(prediction.grad[..., width // 2 :] == 0.0)
    assert torch.all(prediction.grad[..., : width // 2].abs().sum(dim=(0, 1, 2)) > 0)


def test_the_mask_on_the_latent_grid_follows_the_vaes_causal_frames(make_config, shapes_dataset, tmp_path):
    """A mask white on the last four frames only (Wan's VAE: 4 frames a latent frame after the first) is white on
    the last latent frame only; one white on the first frame only is white on the first latent frame only."""
    config = make_config("wan")
    spec = build_spec(config)
    frames, height, width = 9, 32, 32
    vae = spec.load_vae(torch.device("cpu"))
    grid = tuple(spec.prepare_latents(vae, torch.zeros(1, frames, 3, height, width))["latents_mean"].shape[-3:])
    assert grid[0] == 3  # 1 + 8 / 4
    last = -torch.ones(1, 3, frames, height, width)
    last[:, :, 5:] = 1.0
    assert spec.mask_to_latent_grid(last, grid)[0, 0, :, 0, 0].tolist() == [0.0, 0.0, 1.0]
    first = -torch.ones(1, 3, frames, height, width)
    first[:, :, :1] = 1.0
    assert spec.mask_to_latent_grid(first, grid)[0, 0, :, 0, 0].tolist() == [1.0, 0.0, 0.0]
    # LTX-Video's VAE: 8 frames a latent frame after the first.
    assert [len(group) for group in build_spec(make_config("ltx-video")).latent_frame_groups(17, 3)] == [1, 8, 8]
    # A still mask is every frame's; the area average gives the fraction of white pixels in each latent cell.
    still = -torch.ones(1, 3, 1, height, width)
    still[..., :, : width // 2 + 2] = 1.0  # a quarter of the cells straddling the edge is white
    weights = spec.mask_to_latent_grid(still, grid)
    assert weights.shape == (1, 1, *grid) and torch.all(weights[:, :, 0] == weights[:, :, 2])
    assert 0.0 < float(weights[0, 0, 0, 0, grid[2] // 2]) < 1.0


def test_the_masked_error_is_the_white_regions_mean(make_config):
    spec = build_spec(make_config("ltx-video"))
    error = torch.rand(2, 4, 3, 4, 4)
    mask = torch.zeros(2, 1, 3, 4, 4)
    mask[..., :2] = 1.0
    masked = spec.clip_error(error, {LOSS_MASK: mask})
    torch.testing.assert_close(masked, error[..., :2].flatten(1).mean(dim=1))
    assert torch.equal(spec.clip_error(error, {LOSS_MASK: torch.ones_like(mask)}), spec.per_clip_error(error, {}))
    # `masked_loss_area: frame` (kohya's sd-scripts): the weighted error averaged over the whole frame.
    by_frame = spec.clip_error(error, {LOSS_MASK: mask, LOSS_MASK_BY_FRAME: torch.ones(2, dtype=torch.bool)})
    torch.testing.assert_close(by_frame, masked / 2)


def test_resume_with_masks_is_bitwise(make_config, shapes_dataset, tmp_path):
    root = masked_dataset(shapes_dataset, tmp_path / "data", white=LEFT_HALF, still=False)
    settings = {"training": {"steps": 5}, "checkpoint": {"every": 2}}
    build_trainer(_config(make_config, root, **settings, output_dir=str(tmp_path / "reference"))).run()
    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(_config(make_config, root, **settings, output_dir=str(out))), 3)
    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    build_trainer(_config(make_config, root, **settings, output_dir=str(out))).run()
    name = "pytorch_lora_weights.safetensors"
    resumed, reference = load_file(out / name), load_file(tmp_path / "reference" / name)
    assert resumed.keys() == reference.keys() and resumed
    assert all(torch.equal(resumed[key], reference[key]) for key in reference)


def test_masked_loss_is_refused_for_distillation(make_config):
    with pytest.raises(ConfigError, match=r"training\.masked_loss works with a per-element denoising loss"):
        make_config(training={"algorithm": "guidance-distillation", "masked_loss": True})


def test_a_masked_run_names_the_clips_without_a_mask_before_loading(make_config, shapes_dataset, tmp_path):
    config = make_config(training={"masked_loss": True})
    with pytest.raises(DataError, match=r"videos.txt line 1 .*it has no mask, which this run needs"):
        build_trainer(config).set_up()


def test_mask_rect_must_be_a_rectangle_inside_the_frame(tmp_path):
    base = {"model": {"name": "ltx-video", "pretrained": str(tmp_path)}}
    with pytest.raises(ConfigError, match="mask_rect"):
        build_config({**base, "data": {"datasets": [_entry(tmp_path, mask_rect=[0.5, 0.0, 0.2, 1.0])]}})
    with pytest.raises(ConfigError, match="not an input kind"):
        build_config({**base, "data": {"datasets": [_entry(tmp_path, inputs={"masks": "masks.txt"})]}})


def test_masked_loss_area_frame_averages_over_the_whole_frame(make_config, shapes_dataset):
    """The same visit's loss with a half-white mask: over the frame it is half the loss over the mask's area."""
    losses = []
    for area in ("mask", "frame"):
        trainer = build_trainer(_config(make_config, shapes_dataset, entry=_entry(shapes_dataset, mask_rect=LEFT_HALF),
                                        training={"masked_loss_area": area}))
        trainer.set_up()
        context = trainer.context
        with torch.no_grad():
            losses.append(context.loss(context, next(context.source.batches(0))).total)
    torch.testing.assert_close(losses[1], losses[0] / 2)


@pytest.mark.parametrize("family", sorted(TINY_SHAPES))
def test_every_family_takes_a_mask_to_its_latent_grid(make_config, family):
    """Each family's tiny VAE: a mask white on the second half of the width gives its latent grid's second half,
    through the spec's frame grouping of that VAE's real latent frames; an all-white mask leaves the error as is."""
    frames, height, width = TINY_SHAPES[family]
    spec = build_spec(make_config(family))
    vae = spec.load_vae(torch.device("cpu"))
    sound = {"audio": None} if spec.audio_format() is not None else {}
    latents = spec.prepare_latents(vae, torch.zeros(1, frames, 3, height, width), **sound)["latents_mean"]
    grid = tuple(latents.shape[-3:])
    mask = -torch.ones(1, 3, frames, height, width)
    mask[..., width // 2 :] = 1.0
    weights = spec.mask_to_latent_grid(mask, grid)
    assert weights.shape == (1, 1, *grid)
    assert torch.all(weights[..., : grid[2] // 2] == 0.0) and torch.all(weights[..., grid[2] // 2 :] == 1.0)
    error = torch.rand(latents.shape)
    white = spec.mask_to_latent_grid(torch.ones_like(mask), grid)
    assert torch.equal(spec.clip_error(error, {LOSS_MASK: white}), spec.per_clip_error(error, {}))


@pytest.mark.parametrize("algorithm", ["full", "control-lora"])
def test_full_and_control_runs_take_the_mask(make_config, shapes_dataset, tmp_path, algorithm):
    """An all-white mask gives the plain losses; a half mask other ones (the mask reaches the loss)."""
    from tests.helpers.datasets import control_dataset

    root = control_dataset(shapes_dataset, tmp_path / "pairs")[0] if algorithm == "control-lora" else shapes_dataset
    losses = {}
    for name, rect, masked in (("plain", None, False), ("white", [0, 0, 1, 1], True), ("half", list(LEFT_HALF), True)):
        entry = _entry(root, **({"mask_rect": rect} if rect else {}))
        config = _config(make_config, root, masked=masked, entry=entry, output_dir=str(tmp_path / name),
                         training={"algorithm": algorithm, "steps": 2})
        losses[name] = build_trainer(config).run().losses
    assert losses["white"] == losses["plain"] and losses["half"] != losses["plain"]


def test_the_held_out_score_of_a_masked_run_is_masked(make_config, shapes_dataset, tmp_path):
    """The held-out clips are scored on their masks, as the run trains: a white mask scores like no mask, another
    mask otherwise."""
    from tests.evaluation.test_evaluation import score_now

    scores = {}
    for name, rect, masked in (("plain", None, False), ("white", [0, 0, 1, 1], True), ("half", list(LEFT_HALF), True)):
        entry = _entry(shapes_dataset, **({"mask_rect": rect} if rect else {}))
        trainer = build_trainer(_config(make_config, shapes_dataset, masked=masked, entry=entry, training={"steps": 1},
                                        validation={"eval_clips": 1, "eval_noise_levels": [0.5]},
                                        output_dir=str(tmp_path / name)))
        trainer.run()
        scores[name] = score_now(trainer).total
    assert scores["white"] == scores["plain"] and scores["half"] != scores["plain"]
