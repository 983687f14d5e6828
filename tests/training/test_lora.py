"""The LoRA trainer: what it trains, what it saves, and the invariants of its loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import av
import pytest
import torch
import yaml
from PIL import Image

from vidtune import checkpoint
from vidtune.algorithms.losses import apply_caption_dropout
from vidtune.config import load_config
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.errors import ConfigError
from vidtune.trainers import build_trainer


def _final_adapter(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.part.state_dict().items()}


def test_batch_two_equals_two_accumulated_batches_of_one(make_config, tmp_path):
    results = []
    for batch_size, accumulation in ((2, 1), (1, 2)):
        config = make_config(
            training={"steps": 3, "batch_size": batch_size, "gradient_accumulation": accumulation,
                      "learning_rate": 1e-2},
            output_dir=str(tmp_path / f"b{batch_size}a{accumulation}"),
        )
        trainer = build_trainer(config)
        result = trainer.run()
        results.append((_final_adapter(trainer), result.losses))
    (weights_a, losses_a), (weights_b, losses_b) = results
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        # Float summation order differs between the two; Adam turns that into ~1e-5 differences.
        torch.testing.assert_close(weights_a[key], weights_b[key], rtol=1e-3, atol=1e-4)
    assert losses_a == pytest.approx(losses_b, rel=1e-4)
    # And training did move the adapter (a zero update would make the comparison vacuous).
    assert any(v.abs().max() > 0 for k, v in weights_a.items() if "lora_B" in k)


def test_loss_falls_when_one_clip_is_repeated(make_config, tmp_path):
    one_clip = render_shapes_dataset(tmp_path / "one", num_clips=1, num_frames=17, height=32, width=32, fps=24)
    config = make_config(
        data_root=one_clip,
        training={"steps": 120, "batch_size": 4, "learning_rate": 1e-2, "sigma_sampling": "uniform"},
        lora={"rank": 32, "alpha": 32},
        optimizer={"lr_scheduler": "cosine", "warmup_steps": 10},
    )
    losses = build_trainer(config).run().losses
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.85 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"


def test_outputs_of_a_run(make_config, tmp_path):
    config = make_config(
        training={"steps": 4, "batch_size": 2},
        checkpoint={"every": 1, "keep": 2},
        validation={"enabled": True, "num_inference_steps": 2, "every": 2},
    )
    result = build_trainer(config).run()
    out = Path(config.output_dir)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["loss"] > 0 and row["seconds_per_step"] > 0 and "lr" in row for row in rows)

    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step-00000003", "step-00000004"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["training"]["steps"] == 4 and resolved["lora"]["rank"] == config.lora.rank

    assert result.weights_path == out / "pytorch_lora_weights.safetensors"
    with Image.open(out / "loss.png") as image:
        assert image.size[0] > 300
    with Image.open(out / "dataset_overview.png") as image:
        assert image.size[1] > 4 * 40  # a row per clip
    assert len(result.sample_paths) == 1
    # Sampled during the run (validation.every) and at the end.
    assert sorted(p.name for p in (out / "samples").glob("*.mp4")) == ["step-00000002-0.mp4", "step-00000004-0.mp4"]
    with av.open(str(result.sample_paths[0])) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == config.data.frames
    assert (frames[0].height, frames[0].width) == (config.data.height, config.data.width)
    with Image.open(result.sample_paths[0].with_suffix(".png")) as sheet:  # 8 frames grown to 160 px, 2 rows of 4
        assert sheet.size[0] == 4 * 160 + 5 * 6 and sheet.size[1] > 2 * 160


def test_unknown_target_module_is_a_clear_error(make_config):
    config = make_config(lora={"target_modules": ["no_such_layer"]})
    with pytest.raises(ConfigError, match=r"lora\.target_modules"):
        build_trainer(config).run()


def test_caption_dropout_zero_and_empty_run(make_config, tmp_path):
    for technique in ("empty", "zero"):
        config = make_config(data={"caption_dropout": 1.0, "caption_dropout_technique": technique},
                             output_dir=str(tmp_path / technique))
        trainer = build_trainer(config)
        trainer.run()
        captions = ["a red circle"]
        conditions = trainer.spec.prepare_conditions(trainer.context.text, captions)
        dropped = apply_caption_dropout(trainer.context, conditions, torch.tensor([True]))
        if technique == "zero":
            assert torch.count_nonzero(dropped["prompt_embeds"]) == 0
        else:
            empty = trainer.spec.prepare_conditions(trainer.context.text, [""])
            torch.testing.assert_close(dropped["prompt_embeds"], empty["prompt_embeds"])


def test_config_file_round_trip_through_cli_overrides(make_config, tmp_path):
    config = make_config()
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    loaded = load_config(path, ["training.steps=7", "lora.rank=32"])
    assert loaded.training.steps == 7 and loaded.lora.rank == 32
    assert loaded.model == config.model


def test_fp8_base_weights_train_an_adapter_that_loads_in_a_plain_pipeline(make_config, tiny_model_dir):
    from diffusers import LTXPipeline

    config = make_config(training={"steps": 3, "learning_rate": 1e-2}, memory={"fp8_base_weights": True})
    trainer = build_trainer(config)
    result = trainer.run()
    stored = {p.dtype for name, p in trainer.context.denoiser.named_parameters() if "to_q.base_layer.weight" in name}
    assert stored == {torch.float8_e4m3fn}
    adapter = [p for p in trainer.context.denoiser.parameters() if p.requires_grad]
    assert adapter and all(p.dtype == torch.float32 for p in adapter)
    assert all(math.isfinite(loss) for loss in result.losses)
    fp8_bytes = sum(p.numel() * p.element_size() for p in trainer.context.denoiser.parameters() if not p.requires_grad)
    plain = trainer.spec.load_denoiser(torch.device("cpu"))
    assert fp8_bytes < 0.5 * sum(p.numel() * p.element_size() for p in plain.parameters())

    pipeline = LTXPipeline.from_pretrained(tiny_model_dir("ltx-video"))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(config.output_dir)
    video = trainer.spec.sample(pipeline, "a red circle", frames=9, height=32, width=32, num_inference_steps=2,
                                generator=torch.Generator().manual_seed(0)).frames
    assert torch.isfinite(video).all()


def test_fp8_base_weights_need_lora(make_config):
    with pytest.raises(ConfigError, match=r"memory\.base_weights=fp8 works with adapter algorithms"):
        make_config(training={"algorithm": "full"}, memory={"fp8_base_weights": True})
