"""FSDP2 (`parallel.strategy: fsdp`) with real processes on CPU (gloo).

Two ranks with batch 1, each holding half of every weight, must train what one process trains with batch 2 (LoRA
and full fine-tuning, with the weights' moving average); their sharded checkpoint resumes in one process; two
torchrun agents as two "nodes" (c10d rendezvous on localhost) fill one cache and train the same; a rank killed with
SIGKILL is restarted by torchrun (`--max-restarts`) and the run continues from its latest checkpoint, bitwise equal
to one never interrupted (its moving average too). Over a quantized base (int8, fp8, nf4), each rank holds the
whole quantized weights and the adapter is sharded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers.datasets import control_dataset
from tests.helpers.distributed import LORA_FILE, free_port, rank_main, spawn_ranks
from vidtune import checkpoint
from vidtune.control import CONTROL_WEIGHTS
from vidtune.export.command import export_checkpoint
from vidtune.outputs import LORA_EMA_WEIGHTS
from vidtune.parallel.fsdp import FullyShardedStrategy
from vidtune.trainers import build_trainer
from vidtune.trainers.base import TrainResult

FULL_FILE = "transformer/diffusion_pytorch_model.safetensors"
FULL_EMA_FILE = "transformer_ema/diffusion_pytorch_model.safetensors"
EMA = {"ema_decay": 0.5}  # a short decay: three steps move the average well away from the start
# Sharding changes the order of float additions (reduce-scatter instead of one process's sums), nothing else.
RTOL, ATOL = 1e-3, 1e-4
WORKER = Path(__file__).with_name("fsdp_kill_worker.py")


def _assert_close(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert trained.keys() == expected.keys() and expected
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=RTOL, atol=ATOL)


def _losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _recording_rank_main(rank: int, world: int, runs: list, out: str) -> None:
    """`rank_main`, noting for every `fully_shard` call whether the parameters it shards (those not sharded
    already, by the blocks' calls) were all on the meta device: this rank held none of their weights."""
    from torch.distributed import fsdp
    from torch.distributed.tensor import DTensor

    original, calls = fsdp.fully_shard, []

    def recording(module, **options):
        fresh = [p for p in module.parameters() if not isinstance(p, DTensor)]
        calls.append(all(p.is_meta for p in fresh))
        return original(module, **options)

    fsdp.fully_shard = recording
    rank_main(rank, world, runs, out)
    Path(out, f"meta{rank}.json").write_text(json.dumps(calls))


@pytest.mark.slow
def test_two_fsdp_ranks_train_what_one_process_trains_and_resume_in_one(make_config, tmp_path, capsys):
    fsdp = {"parallel": {"strategy": "fsdp"}}

    def config(name: str, **sections) -> dict:
        sections["training"] = {"steps": 3, "learning_rate": 1e-2, **sections.get("training", {})}
        return make_config(output_dir=str(tmp_path / name), **{**fsdp, **sections}).to_dict()

    runs = [
        ("lora", config("lora", checkpoint={"every": 2, "keep": 2}, training=EMA), {}),
        # Every rank reads the weights (by default rank 0 alone does, the other ranks build the denoiser on meta).
        ("every-rank", config("every-rank", parallel={"strategy": "fsdp", "load_on_rank0": False}), {}),
        # HSDP: two replicas of one shard each (as two nodes of one GPU would be).
        ("hsdp", config("hsdp", parallel={"strategy": "fsdp", "replicate_degree": 2}, training=EMA), {}),
        # Validation samples after the last step: rank 0 samples the gathered weights while the others wait.
        ("full", config("full", training={"algorithm": "full", "steps": 2, **EMA},
                        validation={"enabled": True, "num_inference_steps": 2, "prompts": ["a red circle"]}), {}),
    ]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(_recording_rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    # Rank 1 sharded a denoiser without weights (each block, then the rest) in every run but `every-rank`; rank 0
    # always held them. Filled from rank 0, it trains bit for bit what every rank loading the weights trains.
    calls = [json.loads((out / f"meta{r}.json").read_text()) for r in range(2)]
    per_run = len(calls[0]) // len(runs)
    assert len(calls[0]) == len(calls[1]) == per_run * len(runs) and per_run > 2
    assert not any(calls[0])
    assert calls[1] == [name != "every-rank" for name, _, _ in runs for _ in range(per_run)]
    every_rank, lora = load_file(tmp_path / "every-rank" / LORA_FILE), load_file(tmp_path / "lora" / LORA_FILE)
    assert every_rank.keys() == lora.keys() and all(torch.equal(every_rank[k], lora[k]) for k in lora)

    # LoRA: the adapter and the logged losses of one process with batch 2.
    single = build_trainer(make_config(training={"steps": 3, "batch_size": 2, "learning_rate": 1e-2, **EMA},
                                       output_dir=str(tmp_path / "single"))).run()
    trained = load_file(tmp_path / "lora" / LORA_FILE)
    _assert_close(trained, load_file(tmp_path / "single" / LORA_FILE))
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
    # The average of the sharded weights, gathered: what one process averages.
    average = load_file(tmp_path / "lora" / LORA_EMA_WEIGHTS)
    _assert_close(average, load_file(tmp_path / "single" / LORA_EMA_WEIGHTS))
    assert any(not torch.allclose(average[k], trained[k]) for k in trained if "lora_B" in k)
    for result in ranks:
        assert result["lora"]["losses"] == pytest.approx(single.losses, rel=1e-4)
        assert result["lora"]["positions"] == [[0, 2, 4], [1, 3, 5]][ranks.index(result)]
    assert _losses(tmp_path / "lora") == pytest.approx(single.losses, rel=1e-4)
    _assert_close(load_file(tmp_path / "hsdp" / LORA_FILE), load_file(tmp_path / "single" / LORA_FILE))
    _assert_close(load_file(tmp_path / "hsdp" / LORA_EMA_WEIGHTS), average)

    # Checkpoints: one DCP folder per step, a shard file per rank, no single-file weights.
    saved = checkpoint.list_checkpoints(tmp_path / "lora" / "checkpoints")
    assert [p.name for p in saved] == ["step-00000002", "step-00000003"]
    assert sorted(p.name for p in (saved[0] / checkpoint.SHARDS).iterdir()) == [".metadata", "__0_0.distcp",
                                                                                "__1_0.distcp"]
    assert not (saved[0] / checkpoint.WEIGHTS).exists()
    weights, state = checkpoint.load(saved[-1])  # read whole, in this process (as `vidtune export` does)
    assert state["world_size"] == 2 and state["samples_consumed"] == 6 and state["sharded"]
    peft_keys = {key.replace(".default", "") for key in weights}
    assert {key.removeprefix("transformer.") for key in trained} == peft_keys
    assert state["ema_updates"] == 3
    # `vidtune export` of the last sharded checkpoint writes the run's final adapter and average.
    export_checkpoint(saved[-1], tmp_path / "exported")
    for name, final in ((LORA_FILE, trained), (LORA_EMA_WEIGHTS, average)):
        exported = load_file(tmp_path / "exported" / name)
        assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final), name

    # Full fine-tuning: the same equality.
    build_trainer(make_config(training={"algorithm": "full", "steps": 2, "batch_size": 2, "learning_rate": 1e-2,
                                        **EMA}, output_dir=str(tmp_path / "single-full"))).run()
    _assert_close(load_file(tmp_path / "full" / FULL_FILE), load_file(tmp_path / "single-full" / FULL_FILE))
    _assert_close(load_file(tmp_path / "full" / FULL_EMA_FILE), load_file(tmp_path / "single-full" / FULL_EMA_FILE))
    assert json.loads((tmp_path / "full" / "transformer" / "config.json").read_text())["_class_name"] == \
        "LTXVideoTransformer3DModel"
    assert [p.name for p in (tmp_path / "full" / "samples").glob("*.mp4")] == ["step-00000002-0.mp4"]

    # The 2-rank checkpoint of step 2, resumed by one process with batch 2 (the same samples per step): the data
    # position carries over, the change is announced, and the run ends where the 2-rank run ended.
    capsys.readouterr()
    resumed = build_trainer(make_config(
        training={"steps": 3, "batch_size": 2, "learning_rate": 1e-2, **EMA}, output_dir=str(tmp_path / "one"),
        checkpoint={"resume": str(saved[0])}, **fsdp)).run()
    said = capsys.readouterr().out
    assert "The number of processes changed since that checkpoint: 2 -> 1" in said
    assert "has no moving average" not in said  # the average was read from the shards
    assert resumed.first_step == 2 and resumed.losses == pytest.approx(single.losses[2:], rel=1e-4)
    _assert_close(load_file(tmp_path / "one" / LORA_FILE), trained)
    _assert_close(load_file(tmp_path / "one" / LORA_EMA_WEIGHTS), average)


def _torchrun(*arguments: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_two_nodes_and_a_killed_rank_restarted_by_torchrun(make_config, tmp_path):
    cache = str(tmp_path / "cache")

    def write(name: str, **sections) -> Path:
        config = make_config(
            output_dir=str(tmp_path / name), parallel={"strategy": "fsdp"},
            training={"steps": 4, "learning_rate": 1e-2, **EMA},
            checkpoint={"every": 2, "keep": 2, "resume": "latest"},
            precompute={"enabled": True, "batch_size": 1, "cache_dir": cache}, **sections)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config.to_dict()))
        return path

    # Two torchrun agents, one process each, as two nodes meeting at a c10d rendezvous on localhost; they encode
    # their shares of the dataset into one cache and train.
    port = free_port()
    nodes = [subprocess.Popen] * 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))}
    two_nodes = write("two-nodes")
    for node in range(2):
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
             "--rdzv_id", "two-nodes", "-m", "vidtune", "train", str(two_nodes)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outputs = [node.communicate(timeout=400) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    entries = sorted(p.name for p in Path(cache).rglob("*.safetensors"))
    assert len(entries) == len(set(entries)) == 8  # 4 captions and 4 clips, each once

    single = build_trainer(make_config(training={"steps": 4, "batch_size": 2, "learning_rate": 1e-2, **EMA},
                                       output_dir=str(tmp_path / "single"))).run()
    reference = load_file(tmp_path / "two-nodes" / LORA_FILE)
    _assert_close(reference, load_file(tmp_path / "single" / LORA_FILE))
    reference_average = load_file(tmp_path / "two-nodes" / LORA_EMA_WEIGHTS)
    _assert_close(reference_average, load_file(tmp_path / "single" / LORA_EMA_WEIGHTS))
    assert _losses(tmp_path / "two-nodes") == pytest.approx(single.losses, rel=1e-4)

    # One node, two ranks; rank 1 is killed (SIGKILL) in step 3. torchrun stops rank 0 and starts both again,
    # which continue from the checkpoint of step 2: the same adapter and average, bit for bit, as the run never
    # killed.
    started = time.monotonic()
    elastic = _torchrun("--standalone", "--nproc_per_node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
                        str(WORKER), str(write("killed")), "1", "5")
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    assert time.monotonic() - started < 300
    assert "Resuming from" in elastic.stdout and "step-00000002" in elastic.stdout
    resumed = load_file(tmp_path / "killed" / LORA_FILE)
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[key], reference[key]) for key in reference)
    resumed_average = load_file(tmp_path / "killed" / LORA_EMA_WEIGHTS)
    assert resumed_average.keys() == reference_average.keys()
    assert all(torch.equal(resumed_average[key], reference_average[key]) for key in reference_average)
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "two-nodes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("algorithm", ["lora", "full"])
def test_fsdp_in_bf16_with_cpu_offload_on_two_gpus(make_config, tmp_path, algorithm):
    """NCCL, FSDP's bf16 mixed precision (fp32 gradient reduction), shards kept in CPU memory, gradient
    checkpointing: the result and its moving average are finite, saved whole, and close to one GPU's with twice the
    batch."""
    settings = {"model": {"dtype": "bfloat16"}, "training": {"algorithm": algorithm, "steps": 3, "device": "cuda",
                                                             "precision": "bf16", "gradient_checkpointing": True,
                                                             "learning_rate": 1e-3, **EMA}}
    runs = [("gpu", make_config(output_dir=str(tmp_path / "fsdp"), parallel={"strategy": "fsdp", "cpu_offload": True},
                                **settings).to_dict(), {})]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    single = build_trainer(make_config(output_dir=str(tmp_path / "single"), **{
        **settings, "training": {**settings["training"], "batch_size": 2}})).run()
    # The moving average too: its shards sit in CPU memory and are gathered on the GPUs.
    for name in (LORA_FILE, LORA_EMA_WEIGHTS) if algorithm == "lora" else (FULL_FILE, FULL_EMA_FILE):
        trained, expected = load_file(tmp_path / "fsdp" / name), load_file(tmp_path / "single" / name)
        assert trained.keys() == expected.keys()
        for key in expected:  # bf16 compute: a looser tolerance than fp32's
            torch.testing.assert_close(trained[key].float(), expected[key].float(), rtol=2e-2, atol=2e-3)
    for result in ranks:
        assert result["gpu"]["losses"] == pytest.approx(single.losses, rel=2e-2)


def _rank_recording_storage(rank: int, world: int, runs: list, out: str) -> None:
    """`rank_main`, also writing how each run's denoiser is held once FSDP has sharded it: the quantized base
    weights (their class and dtype, whether sharded, their size on this rank) and the adapter's shard sizes."""
    prepare, seen = FullyShardedStrategy.prepare, []

    def recording(self, module, parameters):
        sharded = prepare(self, module, parameters)
        base = module.get_submodule("transformer_blocks.0.attn1.to_q.base_layer").weight
        adapter = module.get_submodule("transformer_blocks.0.attn1.to_q.lora_A.default").weight
        seen.append({"base": f"{type(base).__name__}:{base.dtype}", "base_shape": list(base.shape),
                     "base_sharded": hasattr(base, "placements"), "kept_whole": len(self.kept_whole),
                     "adapter_shard": list(adapter.to_local().shape), "adapter_shape": list(adapter.shape)})
        return sharded

    FullyShardedStrategy.prepare = recording
    rank_main(rank, world, runs, out)
    Path(out, f"storage{rank}.json").write_text(json.dumps(seen))


@pytest.mark.slow
def test_a_quantized_base_stays_whole_on_every_rank_and_trains_what_one_process_trains(make_config, tmp_path):
    """memory.base_weights=int8 / fp8 / nf4 under FSDP: each rank holds the whole quantized base (left out of the
    sharding), the fp32 adapter is sharded; two ranks with batch 1 train what one process trains with batch 2, and
    their sharded checkpoint resumes bit for bit."""
    def config(name: str, option: str, steps: int, **sections) -> dict:
        return make_config(output_dir=str(tmp_path / name), parallel={"strategy": "fsdp"},
                           training={"steps": steps, "learning_rate": 1e-2}, memory={"base_weights": option},
                           **sections).to_dict()

    step_two = tmp_path / "int8" / "checkpoints" / "step-00000002"
    runs = [
        ("int8", config("int8", "int8", 3, checkpoint={"every": 2, "keep": 2}), {}),
        # The same run continued from its step-2 checkpoint by two new ranks.
        ("resumed", config("resumed", "int8", 3, checkpoint={"resume": str(step_two)}), {}),
        # Validation after the last step: rank 0 samples through the gathered adapter and its own fp8 base.
        ("fp8", config("fp8", "fp8", 2, validation={"enabled": True, "num_inference_steps": 2,
                                                    "prompts": ["a red circle"]}), {}),
        ("nf4", config("nf4", "nf4", 2), {}),
    ]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(_rank_recording_storage, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    storage = [json.loads((out / f"storage{r}.json").read_text()) for r in range(2)]

    for seen in storage:  # int8, resumed (int8), fp8, nf4
        assert [s["base"] for s in seen] == ["Int8Tensor:torch.float32", "Int8Tensor:torch.float32",
                                             "Parameter:torch.float8_e4m3fn", "Params4bit:torch.uint8"]
        for held in seen:
            assert not held["base_sharded"] and held["kept_whole"] > 0
            assert held["adapter_shard"][0] * 2 == held["adapter_shape"][0]  # half the rows on each rank

    # The int8 and nf4 kernels round a batch of two a little otherwise than two of one (int8 under DDP: 1.1e-4;
    # here int8 7.9e-5, nf4 2.5e-5); fp8 upcasts each layer's weights exactly, so only the order of additions differs.
    for option, steps, atol in (("int8", 3, 3e-4), ("fp8", 2, ATOL), ("nf4", 2, 3e-4)):
        single = build_trainer(make_config(
            training={"steps": steps, "batch_size": 2, "learning_rate": 1e-2}, memory={"base_weights": option},
            output_dir=str(tmp_path / f"single-{option}"))).run()
        trained = load_file(tmp_path / option / LORA_FILE)
        expected = load_file(tmp_path / f"single-{option}" / LORA_FILE)
        assert trained.keys() == expected.keys() and expected
        for key in expected:
            torch.testing.assert_close(trained[key], expected[key], rtol=RTOL, atol=atol)
        for result in ranks:
            assert result[option]["losses"] == pytest.approx(single.losses, rel=1e-3)

    assert [p.name for p in (tmp_path / "fp8" / "samples").glob("*.mp4")] == ["step-00000002-0.mp4"]
    resumed, uninterrupted = load_file(tmp_path / "resumed" / LORA_FILE), load_file(tmp_path / "int8" / LORA_FILE)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[key], uninterrupted[key]) for key in uninterrupted)
    assert [result["resumed"]["losses"] for result in ranks] == [result["int8"]["losses"][2:] for result in ranks]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_nf4_base_stays_whole_on_each_of_two_gpus(make_config, tmp_path):
    """memory.base_weights=nf4 (bitsandbytes) under FSDP on NCCL: each GPU holds the whole 4-bit base, the adapter is
    sharded, and the result is close to one GPU's with twice the batch (bf16 compute: a looser tolerance)."""
    settings = {"model": {"dtype": "bfloat16"}, "memory": {"base_weights": "nf4"},
                "training": {"steps": 3, "device": "cuda", "precision": "bf16", "learning_rate": 1e-3, **EMA}}
    runs = [("nf4", make_config(output_dir=str(tmp_path / "fsdp"), parallel={"strategy": "fsdp"},
                                **settings).to_dict(), {})]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(_rank_recording_storage, (2, runs, str(out)), nprocs=2)
    for rank in range(2):
        (held,) = json.loads((out / f"storage{rank}.json").read_text())
        assert held["base"].startswith("Params4bit:") and not held["base_sharded"]
        assert held["adapter_shard"][0] * 2 == held["adapter_shape"][0]
    single = build_trainer(make_config(output_dir=str(tmp_path / "single"), **{
        **settings, "training": {**settings["training"], "batch_size": 2}})).run()
    for name in (LORA_FILE, LORA_EMA_WEIGHTS):
        trained, expected = load_file(tmp_path / "fsdp" / name), load_file(tmp_path / "single" / name)
        assert trained.keys() == expected.keys() and expected
        for key in expected:
            torch.testing.assert_close(trained[key].float(), expected[key].float(), rtol=2e-2, atol=2e-3)
    for rank in range(2):
        losses = json.loads((out / f"rank{rank}.json").read_text())["nf4"]["losses"]
        assert losses == pytest.approx(single.losses, rel=2e-2)


@pytest.mark.slow
def test_control_and_distillation_under_fsdp_train_like_one_process_and_resume_in_one(make_config, shapes_dataset,
                                                                                        tmp_path):
    """control-lora / control-full (the widened input layer sharded with the root and trained fully),
    step-distillation (the ranks agree on their number of teacher forwards, which gather weights) and
    guidance-distillation with a full student (its frozen teacher sharded like the student): two ranks x batch 1
    train what one process trains with batch 2, rank 0 samples the gathered control and step-distilled weights, and
    the 2-rank control checkpoint of step 1 resumes in one process."""
    data_root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    fsdp = {"parallel": {"strategy": "fsdp"}}
    algorithms = {
        "control-lora": {"training": {"algorithm": "control-lora", "steps": 2, "learning_rate": 1e-2},
                         "data_root": data_root},
        "control-full": {"training": {"algorithm": "control-full", "steps": 2, "learning_rate": 1e-2},
                         "data_root": data_root},
        "step": {"training": {"algorithm": "step-distillation", "steps": 2, "learning_rate": 1e-2},
                 "distillation": {"student_steps": 2, "teacher_steps": 4}},
        "distillation": {"training": {"algorithm": "guidance-distillation", "steps": 2, "learning_rate": 1e-2},
                         "distillation": {"student": "full"}},
    }
    sampled = {"control-lora", "step"}
    runs = [(name, make_config(output_dir=str(tmp_path / name), checkpoint={"every": 1, "keep": 2}, **fsdp,
                               validation={"enabled": name in sampled, "prompts": ["a red circle"]},
                               **settings).to_dict(), {}) for name, settings in algorithms.items()]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(_recording_rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    # Each run shards its denoiser (every block, then the rest), the full student's run its teacher too; rank 1
    # builds both without weights, with every algorithm's changes (adapters, the widened layer), and rank 0 fills them.
    calls = [json.loads((out / f"meta{r}.json").read_text()) for r in range(2)]
    per_model = len(calls[0]) // (len(runs) + 1)
    assert len(calls[0]) == len(calls[1]) == per_model * (len(runs) + 1) and per_model > 2
    assert not any(calls[0]) and all(calls[1])

    def single(name: str, folder: str, **extra) -> TrainResult:
        settings = algorithms[name]
        return build_trainer(make_config(output_dir=str(tmp_path / folder), **{
            **settings, "training": {**settings["training"], "batch_size": 2}}, **extra)).run()

    files = {"control-lora": [LORA_FILE, CONTROL_WEIGHTS], "control-full": [FULL_FILE, CONTROL_WEIGHTS],
             "step": [LORA_FILE], "distillation": [FULL_FILE]}
    for name in algorithms:
        expected = single(name, f"single-{name}")
        for result in ranks:
            assert "error" not in result[name], result[name]
            assert result[name]["losses"] == pytest.approx(expected.losses, rel=1e-4)
        for file in files[name]:
            _assert_close(load_file(tmp_path / name / file), load_file(tmp_path / f"single-{name}" / file))

    for name in sampled:
        assert [p.name for p in (tmp_path / name / "samples").glob("*.mp4")] == ["step-00000002-0.mp4"]

    # The widened layer trained (its control columns left zero), sharded over the ranks and gathered to save.
    control = load_file(tmp_path / "control-lora" / CONTROL_WEIGHTS)["weight"]
    base_inputs = json.loads((tmp_path / "control-lora" / "control.json").read_text())["in_features"]
    assert control.shape[1] > base_inputs and control[:, base_inputs:].abs().max() > 0

    # The 2-rank control checkpoint of step 1, resumed by one process with batch 2, ends where the 2-rank run ended.
    first = checkpoint.list_checkpoints(tmp_path / "control-lora" / "checkpoints")[0]
    resumed = single("control-lora", "resumed", checkpoint={"resume": str(first)}, **fsdp)
    assert resumed.first_step == 1
    for file in files["control-lora"]:
        _assert_close(load_file(tmp_path / "resumed" / file), load_file(tmp_path / "control-lora" / file))
