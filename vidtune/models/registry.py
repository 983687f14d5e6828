"""Model families by name. Adding a family is one file under models/ and one line here."""

from __future__ import annotations

import importlib

from vidtune.errors import ConfigError
from vidtune.models.spec import ModelSpec

# name -> "module:class", imported lazily so one family's imports never slow down another's.
SPECS: dict[str, str] = {
    "ltx-video": "vidtune.models.ltx_video:LTXVideoSpec",
    "cogvideox": "vidtune.models.cogvideox:CogVideoXSpec",
    "cogvideox-i2v": "vidtune.models.cogvideox:CogVideoXI2VSpec",
    "mochi": "vidtune.models.mochi:MochiSpec",
    "hunyuan-video": "vidtune.models.hunyuan_video:HunyuanVideoSpec",
    "wan": "vidtune.models.wan:WanSpec",
    "wan-i2v": "vidtune.models.wan:WanImageToVideoSpec",
}


def available_models() -> list[str]:
    return sorted(SPECS)


def get_spec_class(name: str) -> type[ModelSpec]:
    if name not in SPECS:
        raise ConfigError(f"model.name: unknown model '{name}'.\nWhat to do: choose one of "
                          f"{', '.join(available_models())}.")
    module_name, class_name = SPECS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
