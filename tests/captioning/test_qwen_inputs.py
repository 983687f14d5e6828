"""The vision inputs made without torchvision match what the model family's own processors make."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vidtune.captioning import qwen_inputs
from vidtune.captioning.frames import frame_indices
from vidtune.captioning.qwen_inputs import VisionSettings, patch_rows, smart_resize


def test_a_still_s_rows_equal_the_qwen2_vl_image_processor_s():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    frame = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    expected = processor(images=[Image.fromarray(frame)], return_tensors="np")
    rows, grid = patch_rows([frame], VisionSettings())
    assert grid == tuple(expected["image_grid_thw"][0]) == (1, 4, 6)
    np.testing.assert_allclose(rows, expected["pixel_values"], atol=1e-5)


def test_video_rows_group_frames_in_time_and_pad_with_the_last_frame():
    settings = VisionSettings()
    frames = [np.full((28, 56, 3), value, dtype=np.uint8) for value in (0, 100, 200)]
    rows, grid = patch_rows(frames, settings)
    assert grid == (2, 2, 4) and rows.shape == (16, 3 * 2 * 14 * 14)
    first = rows.reshape(16, 3, 2, 14, 14)
    red = (np.array([0, 100, 200, 200]) / 255 - settings.mean[0]) / settings.std[0]
    np.testing.assert_allclose(first[:8, 0, :, 0, 0], np.tile(red[:2], (8, 1)), atol=1e-5)  # frames 0 and 1
    np.testing.assert_allclose(first[8:, 0, :, 0, 0], np.tile(red[2:], (8, 1)), atol=1e-5)  # frame 2, repeated
    assert qwen_inputs.placeholder_tokens(grid, settings) == 4


def test_qwen3_vl_writes_each_frame_group_s_time():
    settings = VisionSettings(patch_size=16)
    text = qwen_inputs.video_text("qwen3_vl", (2, 2, 2), [0.0, 0.5, 1.0], settings, "V", "<", ">")
    assert text == "<0.2 seconds><V><1.0 seconds><V>"
    assert qwen_inputs.video_text("qwen2_5_vl", (2, 2, 2), [0.0, 0.5, 1.0], settings, "V", "<", ">") == "VV"


@pytest.mark.parametrize(("height", "width", "budget"), [(1080, 1920, 200704), (48, 48, 200704), (720, 400, 50000)])
def test_frames_are_resized_to_multiples_of_a_merged_patch_within_the_budget(height, width, budget):
    rows, columns = smart_resize(height, width, 28, 3136, budget)
    assert rows % 28 == 0 and columns % 28 == 0 and 3136 <= rows * columns <= budget
    assert abs(np.log(rows / columns) - np.log(height / width)) < 0.2


def test_frames_are_sampled_at_the_rate_and_capped_over_the_whole_clip():
    assert frame_indices(num_frames=48, source_fps=24, fps=2, max_frames=32) == [0, 12, 24, 36]
    assert frame_indices(num_frames=240, source_fps=24, fps=2, max_frames=5) == [0, 60, 120, 179, 239]
    assert frame_indices(num_frames=1, source_fps=24, fps=2, max_frames=5) == [0]
    assert frame_indices(num_frames=10, source_fps=24, fps=2, max_frames=5) == [0]
