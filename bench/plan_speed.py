"""How long `vidtune plan` takes to answer for released models, before and after its tracing shortcuts.

For each hub id, in a fresh interpreter each time: the plan of the README "Will it fit?" table's config (LoRA rank
128, 49x512x768, trained from the cache) and the command's suggestion search for a 24 GiB GPU and a 64 GiB host,
with no traces on disk (`--size`, `--rank`: another clip size, LoRA rank). Two paths, in turns so that a busy
machine slows both alike:
- `old`: every operator on meta runs torch's own shape code (`vidtune.memory.repeated.ENABLED=False`), and a list
  of blocks whose counts do not grow evenly over 2, 3 and 4 blocks is traced whole (`MORE_BLOCKS=0`);
- `new`: repeated operators answered from their first result, and such a list traced with a few more blocks.
Both must give the same plan and the same suggestion (the script stops otherwise). Reported: the process's CPU time
(user + sys; the comparable number on a shared machine) of the plan and of the search, and the wall time.

    python bench/plan_speed.py [--repeats 1] [--size 49x512x768] [--rank 128] [--hub-ids ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HUB_IDS = ["Lightricks/LTX-2", "hunyuanvideo-community/HunyuanVideo", "Wan-AI/Wan2.1-T2V-14B-Diffusers",
           "Wan-AI/Wan2.2-T2V-A14B-Diffusers"]


def one(hub_id: str, path: str, size: str, rank: str) -> dict:
    """Plan `hub_id` on `path` at `size` (FRAMESxHEIGHTxWIDTH) with a LoRA of `rank` in this process; CPU seconds
    of each part."""
    started = time.process_time()
    from vidtune.config import load_config
    from vidtune.memory import plan as planner
    from vidtune.memory import repeated
    from vidtune.memory.architectures import families
    from vidtune.memory.suggest import suggest

    imported = time.process_time()
    if path == "old":
        repeated.ENABLED = False
        planner.MORE_BLOCKS = 0
    frames, height, width = size.split("x")
    config = load_config(None, [f"model.name={families(hub_id)[0]}", f"model.pretrained={hub_id}",
                                f"data.frames={frames}", f"data.height={height}", f"data.width={width}",
                                "precompute.enabled=true", f"lora.rank={rank}", f"lora.alpha={rank}"],
                         required_placeholder="(unset)")
    wall = time.perf_counter()
    plan = planner.plan_memory(config)
    planned = time.process_time()
    found = suggest(config, 24, host_gib=64)
    searched = time.process_time()
    return {"import": imported - started, "plan": planned - imported, "search": searched - planned,
            "wall": time.perf_counter() - wall, "training": plan.training, "precompute": plan.precompute,
            "suggested": None if found is None else found.overrides}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hub-ids", nargs="+", default=HUB_IDS)
    parser.add_argument("--size", default="49x512x768", help="FRAMESxHEIGHTxWIDTH (the tests plan at 17x256x256)")
    parser.add_argument("--rank", default="128", help="the LoRA's rank (the tests plan with the default, 16)")
    parser.add_argument("--one", nargs=4, metavar=("HUB_ID", "PATH", "SIZE", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(*args.one)), flush=True)
        return 0
    print("| hub id | path | plan CPU s | plan + 24 GiB search CPU s | wall s (plan + search) | import CPU s |")
    print("|---|---|---:|---:|---:|---:|")
    for hub_id in args.hub_ids:
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for path in ("old", "new"):
                done = subprocess.run([sys.executable, __file__, "--one", hub_id, path, args.size, args.rank],
                                      cwd=ROOT, text=True, capture_output=True, check=False)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                runs[path].append(json.loads(lines[-1][len("RESULT "):]))
        answers = {(json.dumps(run["training"]), json.dumps(run["precompute"]), json.dumps(run["suggested"]))
                   for path in runs for run in runs[path]}
        if len(answers) != 1:
            print(f"{hub_id}: the paths disagree: {answers}", file=sys.stderr)
            return 1
        for path, results in runs.items():
            median = {key: statistics.median(run[key] for run in results) for key in ("import", "plan", "search",
                                                                                      "wall")}
            print(f"| {hub_id} | {path} | {median['plan']:.1f} | {median['plan'] + median['search']:.1f} | "
                  f"{median['wall']:.1f} | {median['import']:.1f} |", flush=True)
        print(f"<!-- {hub_id}: suggested {runs['new'][0]['suggested']} -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
