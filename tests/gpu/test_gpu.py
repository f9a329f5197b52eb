"""The GPU suite (pytest marker ``gpu``; every test skips without CUDA): what the CPU suite cannot
show, on whatever GPUs the machine has.

    python -m pytest tests/gpu -m gpu -v        # the CPU suite's ``-m 'not slow'`` would skip none

* NCCL process groups: an all-reduce over every GPU there is (up to 4), through the same worker
  pool the CPU suite uses.
* One GPU, fp32: the trainer on CUDA equals the trainer on the CPU (same seed, data and steps;
  the first step as tight as two BLAS libraries allow, later steps through AdamW, looser).
* One GPU, bf16 autocast: close to fp32 on the same GPU (loss, gradient norm, every gradient's
  relative error), which is what bf16 buys and costs.
* Packed documents: FlexAttention's block-sparse kernel (the CUDA path of ``DocumentMask``)
  equals the per-document SDPA the CPU runs, forward and backward; and the trainer with
  ``data.packing = pack`` on the GPU equals the CPU's.
* Every parallel axis on GPUs, fp32 and bf16 (dp, ZeRO-3, tp, pp, cp, ep): each layout against
  one GPU, as the CPU suite does on gloo. Needs 2 GPUs (4 for the 4-rank layouts): skipped with
  fewer, and NCCL refuses two ranks on one GPU.
* The command line on a GPU: ``loom train --nproc 1 --train.device=cuda`` in bf16 learns, writes
  its run directory and reports MFU against the catalog's peak; ``loom generate`` samples from it.

* ``train.compile`` on a GPU (inductor's Triton kernels) equals eager, fp32 and bf16.
* ``train.fp8`` on a GPU with FP8 matmuls (compute capability 8.9+, torchao installed): the real
  float8 GEMMs equal torchao's emulation of them (what the CPU suite tests) up to the tensor
  cores' accumulation, and stay within FP8's rounding of fp32. ``train.fp8_all_gather``: ZeRO-3
  (FSDP2, over a one-rank mesh) gathering the FP8 weights in float8 trains as gathering them in
  the parameters' dtype, fp32 and bf16.
* PipeOffload's accelerator path: a Loom model's saved activations move to pinned host memory
  (the device memory they held is freed, measured with the allocator) and back, and the backward
  equals one without the move (to fp32 reordering: CUDA's embedding backward uses atomics).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from loom.data.loader import prepare_data
from loom.models import TransformerArgs, build_model, reset_parameters
from loom.models.document_attention import DocumentMask
from loom.models.presets import PRESETS
from loom.parallel.data import apply_fully_shard
from loom.parallel.fp8 import (apply_fp8, missing_fp8_matmuls, precompute_all_gather_scales,
                               torchao_available)
from loom.pipeline.host_offload import SavedActivations
from loom.testing.harness import PoolRegistry
from loom.testing.parity import assert_parity, layout_config, record_training
from tests.conftest import SMALL_DATA_OVERRIDES
from tests.data_fixtures import DataCfg, write_short_documents

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(N_GPUS == 0, reason="needs a CUDA GPU")]

STEPS = 3
BASE = {**SMALL_DATA_OVERRIDES, "model.preset": "debug", "train.steps": STEPS,
        "train.global_batch_size": 8, "train.micro_batch_size": 2, "optim.warmup_steps": 1,
        "train.eval_every": 0}


@pytest.fixture(scope="module")
def gpus():
    """NCCL worker pools, one rank per GPU."""
    registry = PoolRegistry(device="cuda", pg_timeout_s=120.0)
    yield registry
    registry.close()


def report(label: str, reference: dict, candidate: dict) -> None:
    """Print (pytest -s, or the log on failure) how far apart two records are, step by step."""
    for step, (ref, got) in enumerate(zip(reference["grads"], candidate["grads"])):
        worst = max(((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                    for n, g in ref.items())
        print(f"{label} step {step + 1}: loss {reference['loss'][step]:.7f} vs"
              f" {candidate['loss'][step]:.7f}; worst gradient max-abs error / max-abs {worst:.2e}")


def assert_close_in_bf16(reference: dict, candidate: dict, label: str) -> None:
    """bf16 agreement. The first step compares the arithmetic: loss and gradient norm within 2%
    relative and every gradient within 2% relative Frobenius error (bf16 keeps 8 bits of
    mantissa). After it AdamW turns bf16's rounding of gradients near zero into full-size updates
    (measured on an H200, bf16 vs fp32: 0.9% worst element at step 1, 6% relative error of one
    weight's gradient at step 2), so later steps compare the loss only, within 1%."""
    for key in ("loss", "grad_norm"):
        ref, got = reference[key][0], candidate[key][0]
        assert abs(got - ref) <= 0.02 * abs(ref), f"{label} step 1 {key}: {got} vs {ref}"
    for name, ref in reference["grads"][0].items():
        got = candidate["grads"][0][name]
        error = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert error <= 0.02, f"{label} step 1 grad of {name}: relative error {error:.3e}"
    for step, (ref, got) in enumerate(zip(reference["loss"], candidate["loss"])):
        assert abs(got - ref) <= 0.01 * ref, f"{label} step {step + 1} loss: {got} vs {ref}"


# -- NCCL ------------------------------------------------------------------------------------------
def _all_reduce_rank_numbers(ctx) -> tuple[str, str, list[float]]:
    values = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(values)
    return dist.get_backend(), str(values.device), values.tolist()


def test_an_nccl_group_reduces_on_every_gpu(gpus):
    world = min(N_GPUS, 4)
    results = gpus.run(world, _all_reduce_rank_numbers, task_timeout_s=120)
    expected = float(world * (world + 1) // 2)
    for rank, (backend, device, values) in enumerate(results):
        assert backend == "nccl"
        assert device == f"cuda:{rank}"
        assert values == [expected] * 4


# -- one GPU against the CPU -------------------------------------------------------------------------
def test_fp32_training_on_a_gpu_equals_the_cpu(dist, gpus, small_data_dir):
    table = layout_config(BASE, 1)
    on_cpu = dist.run(1, record_training, table, small_data_dir, STEPS)[0]
    on_gpu = gpus.run(1, record_training, table, small_data_dir, STEPS)[0]
    report("cuda fp32 vs cpu fp32", on_cpu, on_gpu)
    # Same arithmetic, different kernels (cuBLAS vs the CPU's BLAS, CUDA's SDPA): rounding only.
    assert_parity(on_cpu, on_gpu, rtol=1e-4, atol=1e-6, label="cuda vs cpu", steps=range(1))
    # After AdamW steps a gradient near zero turns its rounding into a full-size update.
    assert_parity(on_cpu, on_gpu, rtol=2e-3, atol=1e-4, label="cuda vs cpu")


def test_bf16_autocast_on_a_gpu_stays_close_to_fp32(gpus, small_data_dir):
    fp32 = gpus.run(1, record_training, layout_config(BASE, 1), small_data_dir, STEPS)[0]
    autocast = layout_config({**BASE, "train.dtype": "bf16_autocast"}, 1)
    bf16 = gpus.run(1, record_training, autocast, small_data_dir, STEPS)[0]
    report("cuda bf16 vs cuda fp32", fp32, bf16)
    assert_close_in_bf16(fp32, bf16, "bf16 vs fp32")


# -- torch.compile ------------------------------------------------------------------------------------
def test_compiled_blocks_on_a_gpu_equal_eager(gpus, small_data_dir):
    """``train.compile`` (inductor's Triton kernels on the GPU): fp32 equal to eager within float
    reordering; bf16 as close to eager bf16 as bf16 is to itself."""
    for dtype in ("fp32", "bf16_autocast"):
        base = {**BASE, "train.dtype": dtype}
        eager = gpus.run(1, record_training, layout_config(base, 1), small_data_dir, STEPS)[0]
        compiled = gpus.run(1, record_training, layout_config({**base, "train.compile": True}, 1),
                            small_data_dir, STEPS, task_timeout_s=600)[0]
        report(f"compiled vs eager {dtype}", eager, compiled)
        if dtype == "fp32":
            assert_parity(eager, compiled, rtol=1e-4, atol=1e-6, label="compiled",
                          steps=range(1))
            assert_parity(eager, compiled, rtol=2e-3, atol=1e-4, label="compiled")
        else:
            assert_close_in_bf16(eager, compiled, "compiled bf16")


# -- FP8 -------------------------------------------------------------------------------------------
FP8_GPU = N_GPUS > 0 and torchao_available() and missing_fp8_matmuls(torch.device("cuda")) is None


def gradient_error(reference: dict, candidate: dict, step: int = 0) -> float:
    """Relative Frobenius error of all gradients of a step together."""
    ref, got = reference["grads"][step], candidate["grads"][step]
    squared = sum(((got[n] - r).double().norm() ** 2).item() for n, r in ref.items())
    return (squared / sum((r.double().norm() ** 2).item() for r in ref.values())) ** 0.5


@pytest.mark.skipif(not FP8_GPU, reason="needs torchao and a GPU with FP8 matmuls (8.9+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_matmuls_on_a_gpu_equal_their_emulation(gpus, small_data_dir, recipe):
    """The GPU runs ``torch._scaled_mm`` on float8 operands; torchao's emulation casts to the
    same float8 values with the same scales and multiplies them in high precision. The first
    layer's matmuls differ only by the tensor cores' accumulation, but from there on a scale
    computed from an amax that moved by rounding shifts the float8 grid, so later casts round
    differently: the real run is the emulated one with another draw of FP8's rounding. Checked:
    the first step's loss within 1e-4 (measured 1.5e-5 on an H100), and the gradients as far from
    the emulation's as the emulation's are from fp32 at most twice over (two independent draws
    of one rounding noise are sqrt(2) apart); the losses of every step within FP8's rounding of
    fp32 (2%) and not equal to them."""
    base = {**BASE, "model.n_kv_heads": 4}
    fp8 = {**base, "train.fp8": recipe}
    fp32 = gpus.run(1, record_training, layout_config(base, 1), small_data_dir, STEPS)[0]
    emulated = gpus.run(1, record_training, layout_config({**fp8, "train.fp8_emulate": True}, 1),
                        small_data_dir, STEPS)[0]
    real = gpus.run(1, record_training, layout_config(fp8, 1), small_data_dir, STEPS)[0]
    report(f"fp8 {recipe} real vs emulated", emulated, real)
    noise, apart = gradient_error(fp32, emulated), gradient_error(emulated, real)
    print(f"fp8 {recipe} step 1 gradients: emulated vs fp32 {noise:.2e}, real vs emulated"
          f" {apart:.2e}, real vs fp32 {gradient_error(fp32, real):.2e}")
    assert real["loss"][0] == pytest.approx(emulated["loss"][0], rel=1e-4)
    assert 0 < apart <= 2 * noise
    for step in range(STEPS):
        assert real["loss"][step] != fp32["loss"][step]  # the matmuls are quantized ...
        assert real["loss"][step] == pytest.approx(fp32["loss"][step], rel=0.02)  # ... no more


def _zero3_fp8_steps(ctx, recipe: str, all_gather: bool, dtype: str,
                     emulate: bool = False) -> dict:
    """The debug model (its blocks' linears in FP8 ``recipe``, or none) sharded by Loom's ZeRO-3
    (FSDP2) over a one-rank mesh, trained STEPS AdamW steps on fixed tokens: losses, every
    gradient, the sharded weights' tensor types and what a converted linear's forward sees as
    its weight. The trainer has no ZeRO at dp_shard = 1 (nothing to shard), but FSDP2 over one
    rank still runs the weights' gather hooks (the cast to float8 before the gather, the float8
    weight after it) and only skips the one-rank collective, so the float8 gather path runs on
    one GPU."""
    args = PRESETS["debug"]
    model = build_model(args, device=ctx.device)
    reset_parameters(model, seed=0)
    converted = apply_fp8(model, recipe, emulate=emulate, fsdp_float8_all_gather=all_gather)
    mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("dp_shard",))
    # as parallelize does for train.dtype = bf16: bf16 gathered copies of the fp32 masters
    apply_fully_shard(model, mesh, cast_forward_inputs=dtype != "bf16",
                      param_dtype=torch.bfloat16 if dtype == "bf16" else None)
    gathered: list[str] = []  # the gathered weight of the first block's wq, at each forward

    def seen(module, _inputs) -> None:
        weight = module.weight
        gathered.append(f"{type(weight).__name__} {getattr(weight, '_data', weight).dtype}")

    model.layers["0"].attention.wq.register_forward_pre_hook(seen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, args.vocab_size, (4, 65),
                           generator=torch.Generator().manual_seed(0)).to(ctx.device)
    record: dict = {"loss": [], "grads": [], "converted": converted,
                    "kinds": sorted({type(p.to_local()).__name__ for p in model.parameters()})}
    for _ in range(STEPS):
        if all_gather:  # as the trainer does before each step's forward
            precompute_all_gather_scales(model)
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        record["loss"].append(loss.item())
        record["grads"].append({n: p.grad.full_tensor().float().cpu()
                                for n, p in model.named_parameters()})
        optimizer.step()
    record["gathered"] = sorted(set(gathered))
    return record


@pytest.mark.skipif(not FP8_GPU, reason="needs torchao and a GPU with FP8 matmuls (8.9+)")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fp8_all_gather_on_a_gpu_trains_as_gathering_the_parameters(gpus, dtype):
    """``train.fp8_all_gather`` with the real float8 GEMMs: ZeRO-3 gathering the FP8 linears'
    weights in float8 (each shard cast with the whole weight's scale, precomputed before each
    step) trains as gathering them in the parameters' dtype and casting after. In fp32 both cast
    the same values with the same scale, so the first step's loss agrees within 1e-4 (the
    tolerance of ``test_fp8_matmuls_on_a_gpu_equal_their_emulation``); under bf16 parameters the
    float8 gather casts the fp32 master where the bf16 gather rounds to bf16 first, another draw
    of FP8's rounding (measured 4e-5 on the CPU, emulated): 1e-3. Later losses within 5e-3, and
    every step's gradients as far apart as FP8's are from the same run without FP8 at most twice
    over (two draws of one rounding noise are sqrt(2) apart). And the float8 gather did run:
    the converted linears' forward gets the gathered weight as torchao's float8 tensor.
    Measured on an H100 (26 Nov 2026): fp32 bit-identical at every step; bf16 step 1 loss 4.1e-5
    apart, gradients 4.0e-2 apart where FP8 moves them 4.8e-2."""
    without = gpus.run(1, _zero3_fp8_steps, "none", False, dtype)[0]
    plain = gpus.run(1, _zero3_fp8_steps, "tensorwise", False, dtype)[0]
    float8 = gpus.run(1, _zero3_fp8_steps, "tensorwise", True, dtype)[0]
    report(f"fp8 all-gather {dtype}", plain, float8)
    assert float8["converted"] == plain["converted"] == 7 * PRESETS["debug"].n_layers
    assert "WeightWithDynamicFloat8CastTensor" in float8["kinds"]
    assert "WeightWithDynamicFloat8CastTensor" not in plain["kinds"]
    print(f"fp8 all-gather {dtype}: wq gathered as {plain['gathered']}, with the float8"
          f" gather as {float8['gathered']}")
    assert float8["gathered"] == ["Float8TrainingTensor torch.float8_e4m3fn"]
    assert [seen.split()[-1] for seen in plain["gathered"]] == [
        "torch.bfloat16" if dtype == "bf16" else "torch.float32"]
    assert float8["loss"][0] == pytest.approx(plain["loss"][0],
                                              rel=1e-4 if dtype == "fp32" else 1e-3)
    for step in range(STEPS):
        assert float8["loss"][step] == pytest.approx(plain["loss"][step], rel=5e-3), step
        noise, apart = gradient_error(without, plain, step), gradient_error(plain, float8, step)
        print(f"fp8 all-gather {dtype} step {step + 1} gradients: fp8 vs none {noise:.2e},"
              f" float8-gathered vs gathered {apart:.2e}")
        assert 0 < noise and apart <= 2 * noise, step


# -- PipeOffload on an accelerator -------------------------------------------------------------------
def test_offloaded_activations_free_gpu_memory_and_return_bit_identical():
    """What ``SavedActivations`` moves leaves the GPU: the allocator's count drops by the bytes
    the store holds (to pinned host memory), returns on reload, and the backward then gives the
    gradients of the model without offloading (to fp32 reordering: see below). A Loom model
    (SDPA on the GPU, whose saved state includes small tensors besides activations) in fp32."""
    args = TransformerArgs(dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=1536,
                           vocab_size=512, max_seq_len=1024)
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (4, 1024), device="cuda")

    def model() -> torch.nn.Module:
        built = build_model(args, device="cuda")
        reset_parameters(built, seed=0)
        return built

    def loss_of(net: torch.nn.Module) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten())

    reference = model()
    loss_of(reference).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    del reference

    net = model()
    store = SavedActivations("0O0", resident=net.buffers())  # RoPE tables stay: the model has them
    with store.hooks():
        loss = loss_of(net)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    on_gpu = [group for group in store.groups() if group.home.type == "cuda"]
    device_bytes = sum(group.nbytes for group in on_gpu)  # the ranges the saved tensors read
    storage_bytes = sum(group.slots[0].tensor.untyped_storage().nbytes() for group in on_gpu)
    store.offload()
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    print(f"offload: {len(store.slots)} saved tensors in {len(store.groups())} storages,"
          f" {store.nbytes / 2**20:.1f} MiB ({device_bytes / 2**20:.1f} MiB on the GPU),"
          f" freed {freed / 2**20:.1f} MiB,"
          f" {store.bytes_moved / store.seconds / 1e9:.1f} GB/s to pinned host memory")
    assert device_bytes > 100 * 2**20
    assert all(not slot.tensor.is_cuda for slot in store.slots)
    # all of it freed (a storage read in part frees whole); the allocator rounds to 512 B
    assert 0.99 * device_bytes <= freed <= 1.01 * storage_bytes
    store.reload()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == pytest.approx(before, rel=0.01)  # views share again
    assert all(slot.tensor.device == slot.home for slot in store.slots)  # host tensors stay
    loss.backward()
    for name, parameter in net.named_parameters():
        # The copies are exact (bit-identical on the CPU: tests/dist/test_pipeline_offload.py),
        # but CUDA's embedding backward sums with atomics: two runs without any offload differ
        # in the last bits (measured on an H100), so the GPU is held to fp32 reordering.
        torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-5, atol=1e-8,
                                   msg=lambda m, n=name: f"{n}: {m}")


# -- packed documents --------------------------------------------------------------------------------
def test_flex_attention_on_a_gpu_equals_per_document_sdpa():
    torch.manual_seed(0)
    B, N, K, S, Hd = 2, 4, 2, 256, 32
    lengths = [[100, 3, 60, 93], [256]]  # several documents in one row, one in the other
    ids = torch.tensor([[doc for doc, n in enumerate(row) for _ in range(n)] for row in lengths],
                       device="cuda")
    q = torch.randn(B, N, S, Hd, device="cuda", requires_grad=True)
    k = torch.randn(B, K, S, Hd, device="cuda", requires_grad=True)
    v = torch.randn(B, K, S, Hd, device="cuda", requires_grad=True)
    out_grad = torch.randn(B, N, S, Hd, device="cuda")
    results = {}
    for kernel in ("flex", "segments"):
        mask = DocumentMask(ids)
        out = mask.attention(q, k, v, kernel=kernel)
        grads = torch.autograd.grad(out, (q, k, v), out_grad)
        results[kernel] = (out.detach(), *grads)
    for name, flex, segments in zip(("out", "dq", "dk", "dv"), results["flex"],
                                    results["segments"]):
        torch.testing.assert_close(flex, segments, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> tuple[str, dict]:
    """Short text files of very different lengths, so packed rows hold several documents."""
    source = tmp_path_factory.mktemp("gpu_docs")
    write_short_documents(source, count=400, seed=5)
    out = tmp_path_factory.mktemp("gpu_docs_data")
    prepare_data(DataCfg(source=str(source), extensions=(".txt",), seq_len=32,
                         val_fraction=0.1), out)
    overrides = {**BASE, "data.source": str(source), "data.extensions": ".txt",
                 "data.seq_len": 32, "data.val_fraction": 0.1, "data.packing": "pack"}
    overrides.pop("data.max_bytes")
    return str(out), overrides


def test_packed_training_on_a_gpu_equals_the_cpu(dist, gpus, short_documents):
    data_dir, overrides = short_documents
    table = layout_config(overrides, 1)
    on_cpu = dist.run(1, record_training, table, data_dir, STEPS)[0]  # per-document SDPA
    on_gpu = gpus.run(1, record_training, table, data_dir, STEPS)[0]  # FlexAttention
    report("packed cuda vs cpu", on_cpu, on_gpu)
    assert_parity(on_cpu, on_gpu, rtol=1e-4, atol=1e-6, label="packed", steps=range(1))
    assert_parity(on_cpu, on_gpu, rtol=2e-3, atol=1e-4, label="packed")


# -- every parallel axis on GPUs ---------------------------------------------------------------------
LAYOUTS = {  # name: (world, degrees, extra overrides)
    "dp2": (2, {"dp_replicate": 2}, {}),
    "zero3-dp2": (2, {"dp_shard": 2, "dp_replicate": 1}, {}),
    "tp2": (2, {"tp": 2, "dp_replicate": 1}, {}),
    "pp2-1f1b": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.schedule": "1f1b"}),
    "pp2-zbv": (2, {"pp": 2, "dp_replicate": 1}, {"parallel.schedule": "zbv"}),
    "cp2": (2, {"cp": 2, "dp_replicate": 1}, {}),
    "ep2-moe": (2, {"ep": 2, "dp_replicate": 1}, {"model.preset": "tiny-moe"}),
    "tp2-pp2": (4, {"tp": 2, "pp": 2, "dp_replicate": 1}, {"parallel.schedule": "1f1b"}),
    "zero3-dp2-tp2": (4, {"dp_shard": 2, "tp": 2, "dp_replicate": 1}, {}),
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16_autocast"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_parallel_axis_on_gpus_equals_one_gpu(gpus, small_data_dir, name, dtype):
    world, degrees, extra = LAYOUTS[name]
    if N_GPUS < world:
        pytest.skip(f"needs {world} GPUs (NCCL: one rank per GPU), found {N_GPUS}")
    base = {**BASE, **extra, "train.dtype": dtype}
    reference = gpus.run(1, record_training, layout_config(base, 1), small_data_dir, STEPS)[0]
    candidate = gpus.run(world, record_training, layout_config(base, world, **degrees),
                         small_data_dir, STEPS)[0]
    report(f"{name} {dtype}", reference, candidate)
    if dtype == "fp32":
        assert_parity(reference, candidate, rtol=1e-4, atol=1e-5, label=name)
    else:  # a different reduction order rounds differently in bf16
        assert_close_in_bf16(reference, candidate, name)


# -- the command line ----------------------------------------------------------------------------------
def test_the_command_line_trains_and_samples_on_a_gpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}

    def loom(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "loom", *args], cwd=tmp_path, env=env,
                              text=True, capture_output=True, timeout=600)

    trained = loom("train", "--nproc", "1", "--train.device=cuda", "--train.dtype=bf16",
                   "--train.steps=40", "--train.run_dir=runs/gpu", "--model.preset=tiny",
                   "--data.max_bytes=400000", "--train.eval_every=40", "--optim.warmup_steps=5")
    assert trained.returncode == 0, trained.stderr[-3000:]
    run = tmp_path / "runs" / "gpu"
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in log if "tokens_per_s" in row]
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"], (steps[0], steps[-1])
    assert steps[-1]["peak_mem_bytes"] > 0
    if any(key in torch.cuda.get_device_name(0).upper() for key in ("H100", "H200", "A100")):
        assert 0 < steps[-1]["mfu"] < 1
    assert (run / "model.safetensors").is_file()
    sampled = loom("generate", "--run", "runs/gpu", "--prompt", "def ", "--max-new-tokens", "20",
                   "--device", "cuda")
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.startswith("def ")
