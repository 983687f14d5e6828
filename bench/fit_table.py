"""README's "Will it fit?" table: `vidtune plan` for a LoRA of every family at one clip size, on cards of
16 / 24 / 48 / 80 GiB (the settings `--gpu-memory` suggests, or "-" when nothing vidtune has makes it fit), on a
host of 64 GiB of RAM (`--host-memory`).

    python bench/fit_table.py                         # 49x512x768, rank 128, precomputed (several minutes)
    python bench/fit_table.py --models Lightricks/LTX-Video --frames 49 --height 512 --width 768
"""

from __future__ import annotations

import argparse
import time

from vidtune.config import build_config
from vidtune.memory.architectures import families
from vidtune.memory.plan import GIB, plan_memory
from vidtune.memory.suggest import suggest

MODELS = ["Lightricks/LTX-Video", "Lightricks/LTX-Video-0.9.7-dev", "THUDM/CogVideoX-5b", "THUDM/CogVideoX1.5-5B",
          "hunyuanvideo-community/HunyuanVideo", "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
          "genmo/mochi-1-preview", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers",
          "Wan-AI/Wan2.1-VACE-1.3B-diffusers", "Wan-AI/Wan2.1-VACE-14B-diffusers",
          "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
          "linoyts/Wan2.2-VACE-Fun-14B-diffusers", "Wan-AI/Wan2.2-Animate-14B-Diffusers",
          "Lightricks/LTX-2",
          "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers",
          "Efficient-Large-Model/SANA-Video_2B_480p_diffusers",
          "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers", "kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers",
          "nvidia/Cosmos-Predict2.5-2B", "nvidia/Cosmos-Predict2.5-14B", "MiniMaxAI/MiniMax-H3"]
SHORT = {"training.gradient_checkpointing=true": "checkpointing", "precompute.enabled=true": "",
         "memory.vae_tiling=true": "", "optimizer.name=adamw8bit": "adamw8bit",
         "optimizer.cpu_offload=true": "optimizer offload", "memory.activation_offload=true": "activation offload"}


def short(overrides: list[str]) -> str:
    """The training-stage changes in a few words (precompute settings are the same for every card)."""
    words = []
    for override in overrides:
        key, _, value = override.partition("=")
        if override in SHORT:
            words.append(SHORT[override])
        elif key == "memory.base_weights":
            words.append(f"{value} base")
        elif key == "memory.blocks_to_swap":
            words.append(f"swap {value} blocks")
        elif key == "memory.text_encoder_weights":
            continue
        else:
            words.append(override)
    return ", ".join(word for word in words if word) or "as is"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--frames", type=int, default=49)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--cards", type=float, nargs="*", default=[16, 24, 48, 80])
    parser.add_argument("--host-memory", type=float, default=64.0, help="the host's RAM in GiB")
    args = parser.parse_args()
    header = " | ".join(f"{card:g} GiB" for card in args.cards)
    print(f"| model | plain LoRA (bf16) | {header} |\n|---|---:|{'---|' * len(args.cards)}", flush=True)
    for hub_id in args.models:
        started = time.perf_counter()
        config = build_config({
            "model": {"name": families(hub_id)[0], "pretrained": hub_id},
            "data": {"root": ".", "frames": args.frames, "height": args.height, "width": args.width},
            "lora": {"rank": args.rank, "alpha": args.rank}, "precompute": {"enabled": True}})
        plain = plan_memory(config)
        cells = []
        for card in args.cards:
            found = suggest(config, card, host_gib=args.host_memory)
            cells.append(f"{short(found.overrides)} ({found.plan.peak / GIB:.1f})" if found else "-")
        seconds = time.perf_counter() - started
        print(f"| {hub_id} | {plain.peak / GIB:.1f} GiB | {' | '.join(cells)} |  <!-- {seconds:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
