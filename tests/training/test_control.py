"""Control training: trained on two (control, target) pairs with one caption, the model follows the control clip
it is given; resumed runs continue exactly; the data sources give each sample its control clip."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.helpers.datasets import CONTROL_CAPTION, control_dataset, pair_samples
from tests.helpers.runs import run_stopped_at
from vidtune.control import ControlInput
from vidtune.data.video import ClipWindow, read_clip
from vidtune.models.registry import get_spec_class
from vidtune.models.spec import ModelSpec
from vidtune.models.tiny import TINY_SHAPES
from vidtune.sampling import load_pipeline
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
CAPTION = CONTROL_CAPTION  # both samples of control_dataset


# What each control algorithm writes beside control_input(_ema).safetensors, with training.ema_decay.
WEIGHTS = {"control-lora": ["pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"],
           "control-full": ["transformer/diffusion_pytorch_model.safetensors",
                            "transformer_ema/diffusion_pytorch_model.safetensors"]}

# (family, algorithm): (steps, learning rate, LoRA rank); each step visits both samples twice.
SETTINGS = {
    ("ltx-video", "control-full"): (300, 1e-2, 32),
    ("ltx-video", "control-lora"): (600, 1e-2, 32),
    ("wan", "control-full"): (400, 3e-3, 32),
    ("cogvideox", "control-full"): (400, 1e-2, 32),
    ("mochi", "control-full"): (400, 5e-3, 32),
    ("hunyuan-video", "control-full"): (400, 5e-3, 32),
    ("wan-i2v", "control-full"): (400, 3e-3, 32),
    ("cogvideox-i2v", "control-full"): (400, 1e-2, 32),
    ("ltx-2", "control-full"): (300, 1e-2, 32),
}


def sampled_latents(spec, pipeline, control: ControlInput, vae, target: Path, control_clip: Path, steps: int = 20):
    """(the target clip's latents, what the pipeline samples following `control_clip`)."""
    frames, height, width = TINY_SHAPES[spec.name]
    clip = read_clip(target, ClipWindow(frames, height, width))
    x0 = spec.prepare_latents(vae, clip[None])["latents_mean"]
    control_video = read_clip(control_clip, ClipWindow(frames, height, width))
    controls = spec.prepare_latents(vae, control_video[None])["latents_mean"]
    with torch.no_grad(), control.given(controls):
        # Image-to-video families also start from the target's first frame, as they trained.
        sampled = spec.sample(pipeline, CAPTION, frames=frames, height=height, width=width, num_inference_steps=steps,
                              generator=torch.Generator().manual_seed(1), reference=clip, output="latents").latents
    return x0, sampled


def relative_error(sampled: torch.Tensor, x0: torch.Tensor) -> float:
    return float((sampled - x0).norm() / x0.norm())


@pytest.mark.slow
@pytest.mark.parametrize(("family", "algorithm"), sorted(SETTINGS))
def test_each_control_clip_brings_back_its_target(family, algorithm, make_config, shapes_dataset, tmp_path):
    root, targets, controls = control_dataset(shapes_dataset, tmp_path / "data")
    steps, learning_rate, rank = SETTINGS[family, algorithm]
    # The clips have no sound: LTX-2 trains their video beside the audio stream (noised silence), as its pipeline
    # samples it, rather than cut off from it (the default, as ltx-trainer's video-only runs).
    sound = {"clips_without_sound": "silence"} if get_spec_class(family).audio_format is not ModelSpec.audio_format \
        else {}
    config = make_config(family, data_root=root, model=sound,
                         training={"algorithm": algorithm, "steps": steps, "learning_rate": learning_rate,
                                   "batch_size": 4, "max_grad_norm": None, "sigma_sampling": "uniform",
                                   "sigma_shift": 1.0},
                         lora={"rank": rank, "alpha": rank, "target_modules": "all-linear"},
                         optimizer={"weight_decay": 0.0, "lr_scheduler": "cosine", "warmup_steps": steps // 10},
                         logging={"progress": False, "log_every": 100})
    started = time.perf_counter()
    build_trainer(config).run()
    trained = load_pipeline(config.output_dir, device="cpu")
    trained.pipeline.set_progress_bar_config(disable=True)
    # The untrained control model: the base model with its input widened (zero weights).
    spec = get_spec_class(family)(config.model, frame_rate=config.frame_rate)
    base_denoiser = spec.load_denoiser(CPU).eval()
    base_control = ControlInput.attach(spec, base_denoiser)
    base = spec.pipeline(spec.load_text_components(CPU), trained.vae, base_denoiser)
    base.set_progress_bar_config(disable=True)
    for name, target, control in (("A", targets[0], controls[0]), ("B", targets[1], controls[1])):
        x0, after = sampled_latents(spec, trained.pipeline, trained.control, trained.vae, target, control)
        _, before = sampled_latents(spec, base, base_control, trained.vae, target, control)
        error, untrained = relative_error(after, x0), relative_error(before, x0)
        print(f"{family} {algorithm}: target {name}: relative error {error:.3f}, untrained {untrained:.3f}, "
              f"ratio {error / untrained:.3f} ({time.perf_counter() - started:.0f} s)")
        assert error < 0.3 * untrained, f"{family}: target {name} {error:.3f} vs untrained {untrained:.3f}"


def _interrupted_then_resumed(make_config, root: Path, out: Path, settings: dict) -> None:

    trainer = build_trainer(make_config(data_root=root, **settings, output_dir=str(out)))
    run_stopped_at(trainer, 3)
    resumed = {**settings, "checkpoint": {**settings["checkpoint"], "resume": "latest"}}
    assert build_trainer(make_config(data_root=root, **resumed, output_dir=str(out))).run().final_step == 5


@pytest.mark.parametrize("algorithm", ["control-lora", "control-full"])
def test_a_resumed_control_run_ends_bit_for_bit_like_one_left_alone(algorithm, make_config, shapes_dataset,
                                                                     tmp_path):
    import json

    from safetensors.torch import load_file

    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    # The weights' moving average is part of the state: it resumes bit for bit too.
    settings = {"training": {"steps": 5, "algorithm": algorithm, "learning_rate": 1e-2, "ema_decay": 0.8},
                "checkpoint": {"every": 2}, "lora": {"dropout": 0.1}}
    build_trainer(make_config(data_root=root, **settings, output_dir=str(tmp_path / "reference"))).run()
    _interrupted_then_resumed(make_config, root, tmp_path / "stopped", settings)
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    files = ["control_input.safetensors", "control_input_ema.safetensors", *WEIGHTS[algorithm]]
    for name in files:
        expected, got = load_file(reference / name), load_file(stopped / name)
        assert expected.keys() == got.keys() and expected
        for key in expected:
            assert torch.equal(expected[key], got[key]), (name, key)
    # The control weights did train (the new inputs are no longer zero).
    weight = load_file(reference / "control_input.safetensors")["weight"]
    in_features = json.loads((reference / "control.json").read_text())["in_features"]
    assert weight[:, in_features:].abs().max() > 0
    losses = [[json.loads(row)["loss"] for row in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (reference, stopped)]
    assert losses[0] == losses[1] and len(losses[0]) == 5


def test_sources_give_each_sample_its_control_clip(shapes_dataset, tmp_path):
    from vidtune.config import DataConfig
    from vidtune.data.sources import read_sources
    from vidtune.errors import DataError

    root, targets, controls = control_dataset(shapes_dataset, tmp_path / "pairs")
    clips = read_sources(DataConfig(root=str(root))).clips
    assert [clip.control for clip in clips] == controls and [clip.video for clip in clips] == targets

    (root / "controls.txt").write_text(f"{controls[0]}\n")
    problems = read_sources(DataConfig(root=str(root))).source_problems
    assert problems == [f"controls.txt line 2 is missing or empty: write the control clip of videos.txt line 2 "
                        f"({targets[1].name}) there; controls.txt has one control clip a line, in the clips' order."]

    table = tmp_path / "clips.csv"
    table.write_text(f"video,caption,edges\n{targets[0]},a,{controls[0]}\n{targets[1]},b,\n")
    source = {"type": "metadata", "path": str(table), "control_column": "edges"}
    report = read_sources(DataConfig(datasets=[source]))
    assert [clip.control for clip in report.clips] == [controls[0]]
    assert report.source_problems == [f"clips.csv row 2 (line 3): the 'edges' value is empty: write the path of the "
                                      f"control clip of {str(targets[1])!r}."]
    jsonl = tmp_path / "clips.jsonl"
    jsonl.write_text(f'{{"video": "{targets[0]}", "caption": "a", "edges": "{controls[1]}"}}\n')
    clips = read_sources(DataConfig(datasets=[{**source, "path": str(jsonl)}])).clips
    assert [clip.control for clip in clips] == [controls[1]]
    with pytest.raises(DataError, match="has no column 'edges'"):
        table.write_text(f"video,caption\n{targets[0]},a\n")
        read_sources(DataConfig(datasets=[source])).raise_problems()


def test_control_training_refuses_what_it_cannot_use(make_config, shapes_dataset, tmp_path):
    from vidtune.errors import ConfigError, DataError

    with pytest.raises(DataError, match=r"videos\.txt line 1 \(.*\) has no control clip\.(.|\n)*controls\.txt"):
        build_trainer(make_config(training={"algorithm": "control-lora"})).run()
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    with pytest.raises(ConfigError, match=r"lora\.target_modules: the adapter would wrap proj_in"):
        build_trainer(make_config(data_root=root, training={"algorithm": "control-lora"},
                                  lora={"target_modules": ["proj_in", "to_q"]})).run()
    # `all-linear` leaves the input layer to train fully.
    trainer = build_trainer(make_config(data_root=root, training={"algorithm": "control-lora"},
                                        lora={"target_modules": "all-linear"}))
    trainer.set_up()
    proj_in = trainer.context.denoiser.proj_in
    assert isinstance(proj_in, torch.nn.Linear) and proj_in.weight.requires_grad
    assert "proj_out" in trainer.part.inner.targets and "proj_in" not in trainer.part.inner.targets


@pytest.mark.parametrize("family", ["ltx-video", "wan-i2v"])
def test_control_batches_from_the_cache_equal_those_encoded_on_the_fly(family, make_config, shapes_dataset,
                                                                        tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    batches = {}
    for cached in (False, True):
        config = make_config(family, data_root=root, training={"algorithm": "control-lora", "batch_size": 2},
                             # One clip per VAE call, as on the fly: the same computation, the same values.
                             precompute={"enabled": cached, "cache_dir": str(tmp_path / "cache"), "batch_size": 1},
                             output_dir=str(tmp_path / f"run-{cached}"))
        trainer = build_trainer(config)
        batches[cached] = next(trainer.set_up().source.batches(0))
    on_the_fly, from_cache = batches[False], batches[True]
    assert torch.equal(on_the_fly.indices, from_cache.indices)
    control = on_the_fly.latents["control_latents"]
    assert control.shape == on_the_fly.latents["latents_mean"].shape
    assert torch.allclose(from_cache.latents["control_latents"], control, atol=1e-6)
    # The control latents are the control clips', not the targets'.
    assert not torch.allclose(control, on_the_fly.latents["latents_mean"], atol=1e-2)


def test_sample_follows_the_control_clip_it_is_given(make_config, shapes_dataset, tmp_path, capsys):
    from safetensors.torch import load_file

    from vidtune.cli import main as cli_main

    root, _, controls = control_dataset(shapes_dataset, tmp_path / "data")
    config = make_config(data_root=root, training={"algorithm": "control-lora", "steps": 2, "learning_rate": 0.1})
    trainer = build_trainer(config)
    trainer.run()
    trained_layer = trainer.part.control.state_dict()
    run = load_pipeline(config.output_dir, device="cpu")
    for key, value in run.control.state_dict().items():
        assert torch.equal(value, trained_layer[key]), key
    latents = []
    for number, control in enumerate([controls[0], controls[1], None]):
        extra = ["--control", str(control)] if control else []
        output, path = tmp_path / f"s{number}.mp4", tmp_path / f"s{number}.safetensors"
        assert cli_main(["sample", config.output_dir, "--prompt", CAPTION, "--steps", "2", "--device", "cpu",
                         "--output", str(output), "--latents", str(path), *extra]) == 0
        assert output.is_file()
        latents.append(load_file(path)["latents"])
    assert "Following the control clip" in capsys.readouterr().out  # without --control: the first clip's
    assert not torch.equal(latents[0], latents[1])  # another control clip, another sample
    assert torch.equal(latents[0], latents[2])
    assert cli_main(["sample", config.output_dir, "--prompt", "x", "--control", str(tmp_path / "no.mp4"),
                     "--device", "cpu"]) == 2
    assert "--control: " in capsys.readouterr().err


def test_canny_controls_are_computed_on_the_fly_and_in_the_cache_alike(make_config, shapes_dataset, tmp_path):
    """`control.processor: canny`: the control of each sample is its own clip's edges, encoded by the VAE; the
    cache keys them by the clip, the preprocessing and the processor, and gives what the data loader computes."""
    from vidtune.processors import canny

    clip = pair_samples(shapes_dataset)[0].video
    frames, height, width = TINY_SHAPES["ltx-video"]
    video = read_clip(clip, ClipWindow(frames, height, width))
    edges = canny(video, {"canny_low": 100, "canny_high": 200})
    assert edges.shape == video.shape and set(edges.unique().tolist()) == {-1.0, 1.0}
    assert not torch.equal(canny(video, {"canny_low": 5, "canny_high": 10}), edges)  # the thresholds act

    batches, keys = {}, {}
    for cached in (False, True):
        config = make_config(training={"algorithm": "control-lora", "batch_size": 2},
                             control={"processor": "canny"},
                             # One clip per VAE call, as on the fly: the same computation, the same values.
                             precompute={"enabled": cached, "cache_dir": str(tmp_path / "cache"), "batch_size": 1},
                             output_dir=str(tmp_path / f"run-{cached}"))
        trainer = build_trainer(config)
        source = trainer.set_up().source
        batches[cached] = next(source.batches(0))
        if cached:
            keys = source.cached.plan.control_windows
    on_the_fly = batches[False].latents["control_latents"]
    assert torch.allclose(batches[True].latents["control_latents"], on_the_fly, atol=1e-6)
    spec = get_spec_class("ltx-video")(config.model, frame_rate=config.frame_rate)
    vae = spec.load_vae(CPU)
    first = int(batches[False].indices[0])
    clip = pair_samples(shapes_dataset)[first].video
    expected = spec.prepare_latents(vae, canny(read_clip(clip, ClipWindow(frames, height, width)),
                                               {"canny_low": 100, "canny_high": 200})[None])["latents_mean"]
    assert torch.allclose(on_the_fly[:1], expected, atol=1e-5)
    # Another threshold is another cache entry.
    other = make_config(training={"algorithm": "control-lora"}, control={"processor": "canny", "canny_low": 50},
                        precompute={"enabled": True, "cache_dir": str(tmp_path / "cache")})
    from vidtune.precompute.plan import build_plan

    trainer = build_trainer(other)
    inputs = trainer.check_inputs()
    assert build_plan(other, trainer.spec, inputs.clips).control_windows[0][0] != keys[0][0]


@pytest.mark.parametrize("algorithm", ["control-lora", "control-full"])
def test_a_checkpoint_exports_what_the_run_writes(algorithm, make_config, shapes_dataset, tmp_path):
    from safetensors.torch import load_file

    from vidtune.export.command import export_checkpoint

    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    config = make_config(data_root=root, checkpoint={"every": 1},
                         training={"algorithm": algorithm, "steps": 2, "learning_rate": 1e-2, "ema_decay": 0.5})
    build_trainer(config).run()
    run, exported = Path(config.output_dir), tmp_path / "exported"
    export_checkpoint(run / "checkpoints" / "step-00000002", exported)
    assert (exported / "control.json").read_text() == (run / "control.json").read_text()
    files = ["control_input.safetensors", "control_input_ema.safetensors", *WEIGHTS[algorithm]]
    for name in files:
        expected, got = load_file(run / name), load_file(exported / name)
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[key], got[key]) for key in expected), name


@pytest.mark.parametrize("algorithm", ["control-lora", "control-full"])
def test_the_control_trainer_starts_from_the_base_model(algorithm, make_config, shapes_dataset, tmp_path):
    """Step 0: the loss of the control trainer (widened input, fresh adapter) is the base algorithm's loss."""
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    losses = []
    for name in (algorithm, algorithm.removeprefix("control-")):
        trainer = build_trainer(make_config(data_root=root, training={"algorithm": name, "batch_size": 2},
                                            output_dir=str(tmp_path / name)))
        trainer.set_up()
        if name == algorithm:
            batch = next(trainer.context.source.batches(0))
        with torch.no_grad():
            losses.append(float(trainer.context.loss(trainer.context, batch).total))
    assert abs(losses[0] - losses[1]) <= 1e-6 * max(1.0, abs(losses[1]))


def test_sampling_a_control_run_takes_the_moving_average_of_its_input_layer_too(make_config, shapes_dataset,
                                                                                   tmp_path):
    from safetensors.torch import load_file

    from vidtune.sampling import load_pipeline

    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    # Trained over a 4-bit base; the adapter and the control input load into the plain pipeline.
    config = make_config(data_root=root, training={"algorithm": "control-lora", "steps": 3, "learning_rate": 1e-2,
                                                   "ema_decay": 0.5}, memory={"base_weights": "nf4"})
    build_trainer(config).run()
    run = Path(config.output_dir)
    plain, averaged = (load_file(run / name)["weight"] for name in ("control_input.safetensors",
                                                                      "control_input_ema.safetensors"))
    assert not torch.equal(plain, averaged)
    for ema, expected in ((None, averaged), (False, plain)):
        loaded = load_pipeline(run, device="cpu", ema=ema)
        assert torch.equal(loaded.control.layer.weight.detach().cpu(), expected)


@pytest.mark.parametrize("base_weights", ["fp8", "int8", "nf4"])
def test_control_lora_keeps_its_input_layer_unquantized_over_a_quantized_base(base_weights, make_config,
                                                                               shapes_dataset, tmp_path):
    """With memory.base_weights quantized, the widened input layer (trained fully) stays a plain fp32 layer, and
    step 0 is still the base model's loss under the same quantized storage (its input layer kept as well)."""
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    memory = {"base_weights": base_weights}
    control = build_trainer(make_config(data_root=root, training={"algorithm": "control-lora", "batch_size": 2},
                                        memory=memory, output_dir=str(tmp_path / "control")))
    control.set_up()

    def stored_plainly(module: torch.nn.Module) -> bool:
        weight = module.weight
        return type(module) is torch.nn.Linear and type(weight.data) is torch.Tensor and weight.dtype == torch.float32

    denoiser = control.context.denoiser
    assert stored_plainly(denoiser.proj_in) and denoiser.proj_in.weight.requires_grad
    frozen = [module for name, module in denoiser.named_modules() if name.endswith("to_q.base_layer")]
    assert frozen and not any(stored_plainly(module) for module in frozen), "the frozen base layers kept fp32"
    base = build_trainer(make_config(data_root=root, training={"algorithm": "lora", "batch_size": 2},
                                     memory=memory, output_dir=str(tmp_path / "lora")))
    base.part.trained_fully = ("proj_in",)  # the same storage as the control run, whose proj_in trains
    base.set_up()
    batch = next(control.context.source.batches(0))
    with torch.no_grad():
        losses = [float(trainer.context.loss(trainer.context, batch).total) for trainer in (control, base)]
    assert abs(losses[0] - losses[1]) <= 1e-6 * max(1.0, abs(losses[1]))
