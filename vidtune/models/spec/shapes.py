"""The clip shapes a family takes: the usual video-VAE rules and one message listing every problem of a shape."""

from __future__ import annotations

from vidtune.errors import ConfigError
from vidtune.models.hub import looks_local
from vidtune.models.spec.base import SpecBase


def nearest_multiple(value: int, multiple: int) -> int:
    """The multiple of `multiple` nearest to `value` (at least one multiple): for shape-rule messages."""
    return max(1, round(value / multiple)) * multiple


def frame_count_problem(frames: int, temporal: int, latent_multiple: int = 1) -> str | None:
    """The usual video-VAE rule: frames = temporal * (latents - 1) + 1, latents a multiple of `latent_multiple`
    (a transformer's temporal patch). Returns the message naming the nearest valid values, or None."""
    latents = (frames - 1) / temporal + 1
    if latents == int(latents) and int(latents) % latent_multiple == 0:
        return None
    valid = [temporal * (n - 1) + 1 for n in range(latent_multiple, frames // temporal + 2 * latent_multiple + 1,
                                                     latent_multiple)]
    nearest = [v for v in valid if v < frames][-1:] + [v for v in valid if v > frames][:1]
    rule = f"{temporal}k+1" if latent_multiple == 1 else f"{temporal}k+1 with k+1 a multiple of {latent_multiple}"
    return (f"data.frames={frames} must be {rule} for this model; nearest valid values: "
            f"{' or '.join(str(v) for v in nearest)}")


def side_problems(height: int, width: int, height_multiple: int, width_multiple: int | None = None) -> list[str]:
    problems = []
    for key, value, multiple in (("data.height", height, height_multiple),
                                 ("data.width", width, width_multiple or height_multiple)):
        if value % multiple != 0:
            problems.append(f"{key}={value} must be a multiple of {multiple} for this model; nearest valid value: "
                            f"{nearest_multiple(value, multiple)}")
    return problems


# The clip rules of each family's published checkpoints (what README.md lists), to compare a model's own rule with.
PUBLISHED_SHAPE_RULES = {
    "ltx-video": "frames 8k+1, sides multiples of 32",
    "ltx-video-i2v": "frames 8k+1, sides multiples of 32",
    "ltx-2": "frames 8k+1, sides multiples of 32",
    "cogvideox": "frames 4k+1, sides multiples of 16",
    "cogvideox-i2v": "frames 4k+1, 480x720",
    "hunyuan-video": "frames 4k+1, sides multiples of 16",
    "hunyuan-video-1.5": "frames 4k+1, sides multiples of 16",
    "hunyuan-video-1.5-i2v": "frames 4k+1, sides multiples of 16",
    "mochi": "frames 6k+1, sides multiples of 16",
    "wan": "frames 4k+1, sides multiples of 16",
    "wan-i2v": "frames 4k+1, sides multiples of 16",
    "skyreels-v2": "frames 4k+1, sides multiples of 16",
    "skyreels-v2-i2v": "frames 4k+1, sides multiples of 16",
    "skyreels-v2-df": "frames 4k+1, sides multiples of 16",
    "sana-video": "frames 4k+1, sides multiples of 32",
    "sana-video-i2v": "frames 4k+1, sides multiples of 32",
}


def shape_rule(temporal: int, latent_multiple: int, height_multiple: int, width_multiple: int | None = None) -> str:
    """A model's clip rule in words, e.g. `frames 8k+1, sides multiples of 32`."""
    frames = f"{temporal}k+1" if latent_multiple == 1 else f"{temporal}k+1 with k+1 a multiple of {latent_multiple}"
    if width_multiple in (None, height_multiple):
        return f"frames {frames}, sides multiples of {height_multiple}"
    return f"frames {frames}, height a multiple of {height_multiple}, width of {width_multiple}"


def raise_shape_problems(family: str, problems: list[str | None], spec: SpecBase | None = None,
                         rule: str = "") -> None:
    """One ConfigError listing every problem of the clip shape. With `spec`, it names the model whose rule it is
    (read from that model's configs: a tiny or custom model has its own) and, for a local model, the published
    checkpoints' rule to compare with."""
    found = [problem for problem in problems if problem]
    if not found:
        return
    if spec is None:
        lines = [f"The clip shape does not fit {family}:"]
    else:
        its_rule = f" (its rule, read from its own configs: {rule})" if rule else ""
        lines = [f"The clip shape does not fit the {spec.name} model at {spec.config.pretrained}{its_rule}:"]
    lines += [f"  - {problem}" for problem in found]
    published = PUBLISHED_SHAPE_RULES.get(spec.name) if spec is not None else None
    if published and looks_local(spec.config.pretrained):
        lines.append(f"For comparison, the published {family} checkpoints need {published}.")
    lines.append("What to do: set the nearest valid values above (data.frames, data.height, data.width; in the config "
                 "or on the command line).")
    raise ConfigError("\n".join(lines))
