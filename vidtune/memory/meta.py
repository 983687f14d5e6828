"""A family's components built from their config.json alone, on the `meta` device (shapes, no data).

The planner loads them through the family spec's own loading code (`load_text_components`, `load_vae`,
`load_denoiser`): only `load_component`, the one place a spec reads weights, is replaced. Every module is built
from its config with `from_config` under `torch.device("meta")`, in the dtype the spec asks for; tokenizers and
image processors are stand-ins that return tensors of the right shape.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import BatchEncoding, BatchFeature

from vidtune.errors import ModelError
from vidtune.models.spec import ModelSpec

META = torch.device("meta")


class ShapeTokenizer:
    """Tokenizes every text to `max_length` tokens (what `padding="max_length"` gives), all of them real: the
    planner needs the shapes of what a tokenizer returns, never its ids."""

    # What specs and pipelines read or set besides calling it (a pad token, the side it pads).
    pad_token = eos_token = "<pad>"
    pad_token_id = eos_token_id = 0
    padding_side = "right"

    def __init__(self, model_max_length: int = 77) -> None:
        self.model_max_length = model_max_length

    def __call__(self, texts: list[str] | str | None = None, max_length: int | None = None, *,
                 text: list[str] | str | None = None, **_: Any) -> BatchEncoding:
        """`texts` or, as a processor is called (Kandinsky 5's Qwen2.5-VL), `text=`; the result reads by attribute
        and by key, and moves with `.to`, as a tokenizer's."""
        texts = text if texts is None else texts
        count = 1 if isinstance(texts, str) else len(texts or [])
        length = max_length or self.model_max_length
        return BatchEncoding({"input_ids": torch.zeros(count, length, dtype=torch.long),
                              "attention_mask": torch.ones(count, length, dtype=torch.long)})

    def decode(self, *_: Any, **__: Any) -> str:
        """No text: the planner's captions have none (Kandinsky 5's pipeline decodes what truncation removes)."""
        return ""

    def encode(self, text: str, **_: Any) -> list[int]:
        """About one token per word: what a pipeline that measures a fixed text (Sana Video's instruction) adds to
        its caption length; the planner needs lengths, never ids."""
        return [0] * (len(text.split()) + 1)

    def apply_chat_template(self, conversations: list[Any], max_length: int | None = None,
                            **_: Any) -> BatchEncoding:
        """Chat-formatted prompts (Qwen2.5-VL's, HunyuanVideo 1.5), tokenized to `max_length` like `__call__`."""
        batch = conversations if conversations and isinstance(conversations[0], list) else [conversations]
        return self(["" for _ in batch], max_length=max_length)


class ShapeImageProcessor:
    """Pixel values of the image encoder's input size for each image."""

    def __init__(self, size: int, where: torch.device = META) -> None:
        self.size = size
        self.where = where

    def __call__(self, images: list[Any] | Any, **_: Any) -> BatchFeature:
        count = len(images) if isinstance(images, (list, tuple)) else 1
        return BatchFeature({"pixel_values": torch.zeros(count, 3, self.size, self.size, device=self.where)})

    preprocess = __call__  # what HunyuanVideo 1.5's image-to-video pipeline calls


def _component_folder(spec: ModelSpec, component: str) -> Path:
    source, subfolder = spec.component_source(component)
    return Path(source) / subfolder if subfolder else Path(source)


def build_from_config(cls: Any, folder: Path, dtype: torch.dtype | None, where: torch.device = META) -> nn.Module:
    """`cls` (a diffusers or transformers model class) from `folder`/config.json, its tensors on `where` (random
    weights on a real device)."""
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder / 'config.json'} is missing: the planner reads each component's config.json.\n"
                         "What to do: point model.pretrained at a complete model folder in the diffusers layout.")
    with torch.device(where):
        if hasattr(cls, "config_class") and hasattr(cls, "_from_config"):  # transformers
            model = cls._from_config(cls.config_class.from_pretrained(folder))
        else:  # diffusers
            model = cls.from_config(cls.load_config(folder))
    if dtype is not None:
        model = model.to(dtype)
    return model


@contextlib.contextmanager
def components_on_meta(spec: ModelSpec, device: torch.device, where: torch.device = META) -> Iterator[None]:
    """While inside: `spec` builds its components from their configs on `meta` (or with random weights on
    `where`), in the dtypes it would load them in on `device`."""

    def load_component(self: ModelSpec, cls: Any, component: str, **kwargs: Any) -> Any:
        folder = _component_folder(self, component)
        if "Tokenizer" in cls.__name__:
            return ShapeTokenizer(_tokenizer_max_length(folder))
        if "ImageProcessor" in cls.__name__:
            return ShapeImageProcessor(_image_size(self), where)
        dtype = kwargs.get("torch_dtype")
        if dtype is not None:
            dtype = self.component_dtype(component, device)
        return build_from_config(cls, folder, dtype, where)

    spec.load_component = types.MethodType(load_component, spec)
    try:
        with _masks_never_read():
            yield
    finally:
        del spec.load_component


@contextlib.contextmanager
def _masks_never_read() -> Iterator[None]:
    """transformers reads an attention mask's values to skip building it when nothing is masked; a meta tensor has
    no values. It does the same for the fake tensors of a traced graph: meta tensors are declared traced too (the
    mask is then built, as it is for any padded caption)."""
    from transformers import masking_utils

    original = masking_utils.is_tracing

    def is_tracing(tensor: torch.Tensor | None = None) -> bool:
        return (isinstance(tensor, torch.Tensor) and tensor.is_meta) or original(tensor)

    masking_utils.is_tracing = is_tracing
    try:
        yield
    finally:
        masking_utils.is_tracing = original


class _Autocast(torch.autocast):
    """`torch.autocast` that accepts the meta device (where it has nothing to do): a model's own autocast region
    (Mochi's rotary embeddings) names the device of its tensors."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


@contextlib.contextmanager
def autocast_on_meta() -> Iterator[None]:
    from torch.fx.experimental import _config as fx_config

    original = torch.autocast
    torch.autocast = _Autocast
    # Selecting a caption's real tokens (Mochi) reads the mask: on meta, every token counts (the longest caption).
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        try:
            yield
        finally:
            torch.autocast = original


def _tokenizer_max_length(folder: Path) -> int:
    """The tokenizer's `model_max_length` from its tokenizer_config.json (what some specs cap captions at), else 77."""
    import json

    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        return int(json.loads(config_file.read_text()).get("model_max_length", 77))
    return 77


def _image_size(spec: ModelSpec) -> int:
    import json

    config = json.loads((_component_folder(spec, "image_encoder") / "config.json").read_text())
    return int(config.get("vision_config", config).get("image_size", 224))
