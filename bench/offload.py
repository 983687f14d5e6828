"""GPU memory of the memory savers of vidtune/offload.py, each against a baseline measured in the same process.

1. Loading a quantized base (`memory.base_weights` int8 / fp8 / nf4): the peak of allocated GPU memory while the
   denoiser is loaded and set up for LoRA, loaded straight onto the GPU and then quantized (as before) against
   loaded and quantized in host memory, then moved (`offload.loading_device`, as now).
2. One training step (forward + backward, LoRA rank 16, gradient checkpointing) of the same denoiser: peak GPU
   memory and step time with `memory.blocks_to_swap` N and with `memory.activation_offload`, as ratios to the plain
   step.

The denoiser is an LTX-Video transformer built from its config with random weights (`--layers 28` is the real 2B
model; fewer layers for a smaller GPU), saved once to a temporary folder and loaded through vidtune's spec.

    python bench/offload.py [--layers 28] [--base-weights int8] [--swap 8] [--tokens 16384]

Needs a CUDA device (it says so and exits 2 without one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig

from vidtune import offload
from vidtune.config import ModelConfig
from vidtune.memory import finish_base_weights, prepare_base_weights
from vidtune.models.ltx_video import LTXVideoSpec

GIB = 2**30


def write_denoiser(folder: Path, layers: int) -> Path:
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LTXVideoTransformer3DModel(num_layers=layers).to(torch.bfloat16)
    model.save_pretrained(folder / "transformer")
    return folder


def set_up(spec: LTXVideoSpec, base_weights: str, load_on: torch.device) -> torch.nn.Module:
    """As the LoRA trainer does: load, freeze, quantize around the adapter, then onto the GPU."""
    denoiser = spec.load_denoiser(torch.device("cuda"), load_on)
    denoiser.requires_grad_(False)
    prepare_base_weights(denoiser, base_weights)
    denoiser.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for parameter in denoiser.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    finish_base_weights(denoiser, base_weights)
    return denoiser.to("cuda")


def loading_peak(spec: LTXVideoSpec, base_weights: str, load_on: torch.device) -> tuple[float, float]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    denoiser = set_up(spec, base_weights, load_on)
    torch.cuda.synchronize()
    peak, held = torch.cuda.max_memory_allocated() / GIB, torch.cuda.memory_allocated() / GIB
    del denoiser
    return peak, held


def step(denoiser: torch.nn.Module, tokens: int, offload_activations: bool) -> tuple[float, float]:
    """Peak GiB and seconds of one forward + backward (the median of three)."""
    frames, side = 4, int((tokens // 4) ** 0.5)
    generator = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(1, frames * side * side, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    text = torch.randn(1, 128, 4096, device="cuda", dtype=torch.bfloat16, generator=generator)
    mask = torch.ones(1, 128, device="cuda")
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        with offload.activation_offload(offload_activations, torch.device("cuda")), \
                torch.autocast("cuda", dtype=torch.bfloat16):
            out = denoiser(hidden, text, torch.tensor([500], device="cuda"), mask, num_frames=frames, height=side,
                           width=side, return_dict=False)[0]
        out.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return torch.cuda.max_memory_allocated() / GIB, sorted(times)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--base-weights", default="int8", choices=["int8", "fp8", "nf4"])
    parser.add_argument("--swap", type=int, default=8, help="memory.blocks_to_swap for the step measurement")
    parser.add_argument("--tokens", type=int, default=16384, help="latent tokens of the step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/offload.py measures GPU memory: it needs a CUDA device.", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        spec = LTXVideoSpec(ModelConfig(name="ltx-video", pretrained=str(write_denoiser(Path(folder), args.layers))))
        print(f"LTX-Video transformer, {args.layers} layers, bf16, base weights {args.base_weights}")
        before = loading_peak(spec, args.base_weights, torch.device("cuda"))
        after = loading_peak(spec, args.base_weights, torch.device("cpu"))
        print(f"load + quantize on the GPU:        peak {before[0]:6.2f} GiB, held after {before[1]:6.2f} GiB")
        print(f"quantize in host memory, then move: peak {after[0]:6.2f} GiB, held after {after[1]:6.2f} GiB  "
              f"(ratio {after[0] / before[0]:.2f})")

        denoiser = set_up(spec, "auto", torch.device("cuda"))
        denoiser.enable_gradient_checkpointing()
        plain = step(denoiser, args.tokens, False)
        print(f"step, {args.tokens} tokens, checkpointing:      peak {plain[0]:6.2f} GiB, {plain[1]:.3f} s")
        offloaded = step(denoiser, args.tokens, True)
        print(f"  + activation offload:                 peak {offloaded[0]:6.2f} GiB ({offloaded[0] / plain[0]:.2f}x),"
              f" {offloaded[1]:.3f} s ({offloaded[1] / plain[1]:.2f}x)")
        swap = offload.apply_block_swap(denoiser, spec.block_lists, args.swap, torch.device("cuda"))
        swapped = step(denoiser, args.tokens, False)
        print(f"  + blocks_to_swap={args.swap}:                  peak {swapped[0]:6.2f} GiB "
              f"({swapped[0] / plain[0]:.2f}x), {swapped[1]:.3f} s ({swapped[1] / plain[1]:.2f}x)")
        swap.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
