"""A source's caption options, and the caption each visit of a sample reads.

- `trigger`: a word added to every caption of a source, before it (`prefix`) or after it (`suffix`); a sample keeps
  its caption without the trigger too (`Clip.untriggered`), which `training.preserve_base` trains on;
- `shuffle_tags` / `keep_tokens`: tag-style captions (`tag1, tag2, ...`) have their comma-separated tags shuffled
  at every draw, the first `keep_tokens` tags kept in place (as kohya-style trainers do); the trigger is added
  after the shuffle, so it stays where it is put;
- `caption_dropout`: a source's own probability of dropping a caption (the draw itself is the loss's, from the
  visit's generator: `vidtune.algorithms.losses.noisy_inputs`).

Every draw is keyed by (seed, stream position) like the visit's noise, so a resumed run reads the same captions.
From the precompute cache a visit reads one of a fixed number of shuffles (`shuffle_variants`), each a pure function
of (seed, sample, number), whose conditions the cache holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Seed offsets of the caption draws, apart from the visit's noise and frame window.
SHUFFLE_SEED_OFFSET = 13
VARIANT_SEED_OFFSET = 17
PROMPT_SEED_OFFSET = 19


@dataclass(frozen=True)
class CaptionStyle:
    """A source's caption options (the defaults change nothing)."""

    trigger: str = ""
    trigger_position: str = "prefix"
    shuffle_tags: bool = False
    keep_tokens: int = 0
    dropout: float | None = None  # None: data.caption_dropout

    def with_trigger(self, caption: str) -> str:
        """`caption` with the trigger added where it goes (as it is: without a trigger)."""
        if not self.trigger:
            return caption
        joint = ", " if self.shuffle_tags else " "
        return f"{self.trigger}{joint}{caption}" if self.trigger_position == "prefix" else f"{caption}{joint}" \
            f"{self.trigger}"

    def shuffled(self, caption: str, generator: torch.Generator) -> str:
        """The caption's comma-separated tags in an order drawn from `generator`, the first `keep_tokens` kept."""
        tags = split_tags(caption)
        kept, moving = tags[: self.keep_tokens], tags[self.keep_tokens:]
        order = torch.randperm(len(moving), generator=generator).tolist() if len(moving) > 1 else range(len(moving))
        return ", ".join([*kept, *(moving[i] for i in order)])


def split_tags(caption: str) -> list[str]:
    """The comma-separated tags of a caption, stripped, empty ones left out."""
    return [tag.strip() for tag in caption.split(",") if tag.strip()]


def shuffle_generator(seed: int, key: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_039 + key * 92_821 + SHUFFLE_SEED_OFFSET) % 2**63)


def visit_generator(seed: int, position: int, offset: int) -> torch.Generator:
    """A visit's own generator for one kind of caption draw (`offset`), apart from its noise and window."""
    return torch.Generator().manual_seed((seed * 1_000_081 + position * 15_485_863 + offset) % 2**63)


def visit_untriggered(style: CaptionStyle, untriggered: str, seed: int, position: int) -> str:
    """The caption without its trigger as one visit (on the fly) reads it: shuffled afresh with `shuffle_tags`."""
    if not style.shuffle_tags:
        return untriggered
    return style.shuffled(untriggered, shuffle_generator(seed, position))


def shuffle_variants(style: CaptionStyle, untriggered: str, seed: int, index: int, count: int) -> list[str]:
    """`count` distinct fixed shuffles of sample `index`'s caption without its trigger (what the cache holds; fewer
    when its tags have fewer orders), a pure function of (seed, index); without `shuffle_tags` the caption alone."""
    if not style.shuffle_tags:
        return [untriggered]
    generator = shuffle_generator(seed + 1, -1 - index)
    variants: list[str] = []
    for _ in range(count * 20):  # repeated orders are drawn again, a bounded number of times
        drawn = style.shuffled(untriggered, generator)
        if drawn not in variants:
            variants.append(drawn)
        if len(variants) == count:
            break
    return variants


def variant_of_visit(count: int, seed: int, position: int) -> int:
    """Which of `count` cached shuffles a visit reads."""
    if count <= 1:
        return 0
    return int(torch.randint(0, count, (1,), generator=visit_generator(seed, position, VARIANT_SEED_OFFSET)))


def preservation_caption(untriggered: str, style: CaptionStyle, prompts: Sequence[str] | None, class_word: str,
                         seed: int, position: int) -> str:
    """The caption `training.preserve_base` trains a visit on: one of `prompts`, drawn by the visit's generator, or
    the visit's caption without its trigger, the trigger replaced by `class_word` (removed when empty)."""
    if prompts:
        pick = int(torch.randint(0, len(prompts), (1,), generator=visit_generator(seed, position, PROMPT_SEED_OFFSET)))
        return prompts[pick]
    if class_word and style.trigger:
        return CaptionStyle(class_word, style.trigger_position, style.shuffle_tags).with_trigger(untriggered)
    return untriggered
