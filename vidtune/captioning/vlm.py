"""A vision-language model of the Qwen2-VL family that writes one caption per clip or still, a batch at a time.

The model is any Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint transformers loads (`AutoModelForImageTextToText`):
a hub id or a local folder. Its tokenizer, chat template and preprocessor config are read from the same place;
the vision inputs are made by `qwen_inputs` (no torchvision needed). Decoding is greedy, so a caption depends on
the clip and the settings only (as Lightricks' ltx-trainer captioner, `do_sample=False`).
"""

from __future__ import annotations

import inspect
import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vidtune.captioning import qwen_inputs
from vidtune.captioning.qwen_inputs import VisionSettings
from vidtune.errors import ModelError
from vidtune.models.hub import looks_local, offline_mode

_VIDEO, _IMAGE = "<|video_pad|>", "<|image_pad|>"
_START, _END = "<|vision_start|>", "<|vision_end|>"
# Openings a VLM likes that say nothing about the clip (cut as ltx-trainer's captioner cuts them).
_FILLER = re.compile(r"^(?:the|this) (?:video|image|clip|scene|footage|animated sequence) "
                     r"(?:shows|displays|features|depicts|presents|showcases|captures|contains) ", re.IGNORECASE)


@dataclass(frozen=True)
class Media:
    """One sample to caption: its frames (uint8 [H, W, 3], one size, sides multiples of the model's factor), the
    time of each in seconds, and whether it is a still."""

    frames: list[np.ndarray]
    times: list[float]
    is_image: bool


def clean_caption(text: str) -> str:
    """The model's answer as a training caption: one line without control characters, without a filler opening,
    its first letter upper case."""
    text = "".join(char if unicodedata.category(char)[0] != "C" else " " for char in text)
    text = " ".join(text.split())
    stripped = _FILLER.sub("", text, count=1)
    if stripped != text and stripped:
        stripped = stripped[0].upper() + stripped[1:]
    return stripped


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on a GPU, float32 on the CPU (as the rest of vidtune)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _model_error(model: str, reason: str) -> ModelError:
    if looks_local(model):
        where = f"the folder {Path(model).expanduser().resolve()}"
        what = "point it at a folder holding a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model (config.json, weights, tokenizer)"
    else:
        where = f"the hub model {model!r}"
        offline = " (HF_HUB_OFFLINE=1 is set: only models already in the hub cache are found)" if offline_mode() else ""
        what = f"check the id (e.g. Qwen/Qwen2.5-VL-7B-Instruct), or download it and give its folder{offline}"
    return ModelError(f"caption.model (--model): {where} {reason}. Nothing was captioned.\nWhat to do: {what}.")


def _read_json(model: str, name: str, revision: str | None) -> dict[str, Any] | None:
    """A JSON file of the model (a folder's or the hub's), or None when it has none."""
    if looks_local(model):
        path = Path(model).expanduser() / name
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    from transformers.utils import cached_file

    found = cached_file(model, name, revision=revision, _raise_exceptions_for_missing_entries=False)
    return json.loads(Path(found).read_text(encoding="utf-8")) if found else None


class Captioner:
    """A loaded model, its tokenizer and vision settings. `caption(batch, instructions)` answers each sample."""

    def __init__(self, model: str, device: torch.device, dtype: torch.dtype, max_new_tokens: int,
                 revision: str | None = None) -> None:
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

        if looks_local(model) and not Path(model).expanduser().is_dir():
            raise _model_error(model, "does not exist")
        try:
            config = AutoConfig.from_pretrained(model, revision=revision)
        except (OSError, ValueError) as error:
            raise _model_error(model, f"cannot be read as a model ({_first_line(error)})") from None
        self.model_type = getattr(config, "model_type", "")
        if self.model_type not in qwen_inputs.MODEL_TYPES:
            raise _model_error(model, f"is a {self.model_type or 'unknown'} model; captioning reads video with the "
                               f"Qwen2-VL family ({', '.join(qwen_inputs.MODEL_TYPES)})")
        settings = _read_json(model, "video_preprocessor_config.json", revision) or \
            _read_json(model, "preprocessor_config.json", revision) or {}
        self.settings: VisionSettings = qwen_inputs.vision_settings(settings)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model, revision=revision, padding_side="left")
            self.model = AutoModelForImageTextToText.from_pretrained(model, revision=revision, dtype=dtype)
        except (OSError, ValueError) as error:
            raise _model_error(model, f"cannot be loaded ({_first_line(error)})") from None
        self.template = self.tokenizer.chat_template or _chat_template(model, revision)
        if not self.template:
            raise _model_error(model, "has no chat template (chat_template.jinja or chat_template.json)")
        self.model.to(device).eval()
        self.device, self.dtype = device, dtype
        self.max_new_tokens = max_new_tokens
        parameters = inspect.signature(self.model.forward).parameters
        self._takes = {name for name in ("mm_token_type_ids", "second_per_grid_ts") if name in parameters}
        self._ids = {token: self.tokenizer.convert_tokens_to_ids(token) for token in (_VIDEO, _IMAGE)}

    def prompt(self, media: Media, instruction: str, grid: tuple[int, int, int]) -> str:
        """The chat the model answers: the sample's placeholder tokens (expanded to its patches) and the
        instruction, in the model's own chat template."""
        kind = "image" if media.is_image else "video"
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": instruction}]}]
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True)
        if media.is_image:
            return text.replace(_IMAGE, _IMAGE * qwen_inputs.placeholder_tokens(grid, self.settings), 1)
        expanded = qwen_inputs.video_text(self.model_type, grid, media.times, self.settings, _VIDEO, _START, _END)
        marked = f"{_START}{_VIDEO}{_END}"
        if self.model_type in qwen_inputs.TIMESTAMPED and marked in text:  # each group carries its own markers
            return text.replace(marked, expanded, 1)
        return text.replace(_VIDEO, expanded, 1)

    @torch.inference_mode()
    def caption(self, batch: Sequence[Media], instructions: Sequence[str]) -> list[str]:
        """One cleaned caption per sample of `batch` (possibly empty when the model says nothing)."""
        texts, images, videos, image_grids, video_grids, seconds = [], [], [], [], [], []
        for media, instruction in zip(batch, instructions, strict=True):
            rows, grid = qwen_inputs.patch_rows(media.frames, self.settings)
            texts.append(self.prompt(media, instruction, grid))
            (images if media.is_image else videos).append(rows)
            (image_grids if media.is_image else video_grids).append(grid)
            if not media.is_image:
                seconds.append(self.settings.temporal_patch_size / _frame_rate(media.times))
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        extra: dict[str, torch.Tensor] = {}
        if images:
            extra["pixel_values"] = self._pixels(images)
            extra["image_grid_thw"] = torch.tensor(image_grids, dtype=torch.long)
        if videos:
            extra["pixel_values_videos"] = self._pixels(videos)
            extra["video_grid_thw"] = torch.tensor(video_grids, dtype=torch.long)
            if "second_per_grid_ts" in self._takes and self.model_type in qwen_inputs.SECONDS_PER_GRID:
                extra["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        if "mm_token_type_ids" in self._takes:
            ids = inputs["input_ids"]
            extra["mm_token_type_ids"] = (ids == self._ids[_IMAGE]).int() + 2 * (ids == self._ids[_VIDEO]).int()
        inputs = {name: value.to(self.device) for name, value in {**inputs, **extra}.items()}
        output = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                     pad_token_id=self.tokenizer.pad_token_id)
        answers = self.tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        return [clean_caption(answer) for answer in answers]

    def _pixels(self, rows: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(rows)).to(self.dtype)


def _frame_rate(times: Sequence[float]) -> float:
    """Frames per second of sampled frames (their mean spacing); 1 for a single frame."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 1.0
    return (len(times) - 1) / (times[-1] - times[0])


def _chat_template(model: str, revision: str | None) -> str | None:
    """A processor's chat template (chat_template.json), for models whose tokenizer has none."""
    found = _read_json(model, "chat_template.json", revision)
    return found.get("chat_template") if found else None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
