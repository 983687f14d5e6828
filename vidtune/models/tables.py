"""The Markdown tables of every registered family's training defaults and noise levels (docs/models.md; a test keeps
them in sync). Run `python -m vidtune.models.tables` to print them."""

from __future__ import annotations

from vidtune.models.registry import available_models, get_spec_class


def defaults_table() -> str:
    """The Markdown table of every registered family's defaults (docs/models.md)."""
    lines = ["| family | clip (frames x height x width) | fps | noise levels (training) | validation guidance | "
             "source |", "|---|---|---|---|---|---|"]
    for name in available_models():
        spec = get_spec_class(name)
        d = spec.defaults
        noise = d.describe_noise()
        # A family whose guidance depends on the checkpoint (Wan 2.2: TI2V-5B or A14B) says so in its source.
        guidance = spec.validation_guidance_scale
        guidance = f"{guidance:g}" if isinstance(guidance, float | int) else "by checkpoint"
        lines.append(f"| `{name}` | {d.frames} x {d.height} x {d.width} | {d.fps:g} | {noise} | {guidance} | "
                     f"{d.source} |")
    return "\n".join(lines) + "\n"


def noise_table() -> str:
    """The Markdown table of every registered family's training noise levels and where they come from
    (docs/models.md)."""
    lines = ["| family | noise levels (training) | source |", "|---|---|---|"]
    for name in available_models():
        d = get_spec_class(name).defaults
        lines.append(f"| `{name}` | {d.describe_noise()} | {d.noise_source} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(defaults_table(), end="")
    print()
    print(noise_table(), end="")
