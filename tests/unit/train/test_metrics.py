"""Specifications for loom.train.flops, loom.train.metrics and loom.train.plots."""

from __future__ import annotations

import io
import json
import math
import time
from fractions import Fraction

import pytest
import torch

from loom.train import flops, metrics
from loom.formulas.flops import training_flops_per_token
from loom.train.flops import describe_peak, device_peak_flops
from loom.train.metrics import (MetricsLogger, StepPace, StepTimer, format_eta,
                                peak_memory_bytes)
from loom.train.plots import plot_loss_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def mha(h: int, n_heads: int, **kw: int) -> dict[str, int]:
    """Multi-head (not grouped) attention shapes with n_heads · head_dim = h."""
    return dict(dim=h, n_heads=n_heads, n_kv_heads=n_heads, head_dim=h // n_heads, **kw)


# ---------------------------------------------------------------- FLOP formula


def test_hand_counted_small_model() -> None:
    # h=4, one layer, 2 query heads sharing 1 KV head of size 2, f=8, V=10, s=3.
    # Forward FLOPs per token, 2 per multiply-add:
    q, k, v, o = 2 * 4 * 4, 2 * 4 * 2, 2 * 4 * 2, 2 * 4 * 4
    mlp = 3 * 2 * 4 * 8
    scores, values = 2 * 3 * 4, 2 * 3 * 4  # s · (H·d) multiply-adds each
    head = 2 * 4 * 10
    forward = q + k + v + o + mlp + scores + values + head
    got = training_flops_per_token(dim=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2,
                                   ffn_dim=8, vocab_size=10, seq_len=3)
    assert got == 3 * forward == 1248
    halved = training_flops_per_token(dim=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2,
                                      ffn_dim=8, vocab_size=10, seq_len=3, halve_causal=True)
    assert halved == 3 * (forward - (scores + values) / 2)
    not_causal = training_flops_per_token(dim=4, n_layers=1, n_heads=2, n_kv_heads=1,
                                          head_dim=2, ffn_dim=8, vocab_size=10, seq_len=3,
                                          causal=False, halve_causal=True)
    assert not_causal == got  # nothing is masked, so nothing to halve


def test_reduces_to_palm_6n_plus_12lhs() -> None:
    h, l, s, V, f = 256, 4, 512, 3000, 688
    got = training_flops_per_token(**mha(h, 8, n_layers=l, ffn_dim=f, vocab_size=V, seq_len=s))
    n_matmul_params = l * (4 * h * h + 3 * h * f) + h * V  # q,k,v,o + SwiGLU, plus the head
    assert got == 6 * n_matmul_params + 12 * l * h * s


def test_reduces_to_megatron_eq7_for_gpt_mlp_size() -> None:
    # SwiGLU with f = 8h/3 has the 8h² MLP weights of GPT's 4h MLP (h divisible by 3).
    h, l, s, V, B = 96, 3, 128, 1000, 5
    f = 8 * h // 3
    assert 3 * h * f == 8 * h * h
    per_token = training_flops_per_token(**mha(h, 8, n_layers=l, ffn_dim=f, vocab_size=V,
                                               seq_len=s))
    eq7 = 72 * B * s * l * h**2 * (1 + Fraction(s, 6 * h) + Fraction(V, 12 * h * l))
    assert Fraction(per_token) * B * s == eq7


def test_agrees_with_the_model_parameter_count_for_a_gqa_preset() -> None:
    from loom.models.presets import parameter_count, preset

    args, s = preset("llama3-8b"), 8192  # untied head, 8 KV heads for 32 query heads
    norms = (2 * args.n_layers + 1) * args.dim  # norm weights are not matmuls
    n_matmul = parameter_count(args, include_embedding=False) - norms
    got = training_flops_per_token(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                                   n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
                                   ffn_dim=args.ffn_dim, vocab_size=args.vocab_size, seq_len=s)
    assert got == 6 * n_matmul + 12 * args.n_layers * s * args.n_heads * args.head_dim


def test_grouped_query_attention_removes_kv_projection_flops() -> None:
    h, l, H, d = 128, 2, 8, 16
    common = dict(dim=h, n_layers=l, n_heads=H, head_dim=d, ffn_dim=344, vocab_size=500,
                  seq_len=64)
    full = training_flops_per_token(n_kv_heads=H, **common)
    for kv in (4, 2, 1):
        gqa = training_flops_per_token(n_kv_heads=kv, **common)
        # k and v projections shrink from h x H·d to h x kv·d; 6 FLOPs per weight per token.
        assert full - gqa == 6 * l * 2 * h * d * (H - kv)
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        training_flops_per_token(n_kv_heads=3, **common)
    with pytest.raises(ValueError, match="seq_len=0"):
        training_flops_per_token(**{**common, "seq_len": 0}, n_kv_heads=H)


# ---------------------------------------------------------------- device peak


def test_a_cpu_has_no_stated_peak_unless_one_is_given() -> None:
    peak, why = device_peak_flops(torch.device("cpu"), torch.float32)
    assert peak is None and "metrics.peak_tflops" in why
    assert describe_peak(peak, why).startswith("MFU n/a (")
    assert device_peak_flops("cpu", torch.float32, 2.5) == (2.5e12, "metrics.peak_tflops")
    assert describe_peak(2.5e12, "metrics.peak_tflops") == (
        "MFU against 2.5 TFLOP/s per device (metrics.peak_tflops)")


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA H200", 989e12), ("NVIDIA B200", 2.25e15), ("AMD Instinct MI300X", 1300e12),
    ("AMD Instinct MI250X", 383e12), ("NVIDIA RTX A6000", 154.85e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA H800", 989e12), ("NVIDIA H800 PCIe", 756e12),
])
def test_known_gpu_peaks_come_from_the_catalog(monkeypatch: pytest.MonkeyPatch, name: str,
                                              peak: float) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    got, source = device_peak_flops(torch.device("cuda"), torch.bfloat16)
    assert got == peak and source.startswith("catalog ") and source.endswith(name)
    # a stated peak wins over the catalog's
    assert device_peak_flops(torch.device("cuda"), torch.bfloat16, 100.0)[0] == 100e12


def test_unknown_gpu_or_fp32_has_no_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    peak, why = device_peak_flops(torch.device("cuda"), torch.float32)
    assert peak is None and "dense BF16" in why and "float32" in why
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9000")
    peak, why = device_peak_flops(torch.device("cuda"), torch.bfloat16)
    assert peak is None and "Mystery GPU 9000" in why and "not in the catalog" in why


# What torch.cuda.get_device_name says for each accelerator of the planner's catalog.
CATALOG_DEVICE_NAMES = {
    "A100-40GB": "NVIDIA A100-SXM4-40GB", "A100-80GB": "NVIDIA A100-SXM4-80GB",
    "H100-SXM": "NVIDIA H100 80GB HBM3", "H100-NVL": "NVIDIA H100 NVL",
    "H100-PCIe": "NVIDIA H100 PCIe", "H200": "NVIDIA H200", "B200": "NVIDIA B200",
    "H800": "NVIDIA H800",
    "MI250X": "AMD Instinct MI250X", "MI300X": "AMD Instinct MI300X",
}


def test_the_trainers_peaks_are_the_planners_catalog() -> None:
    """The trainer keeps its own name table (it sits below the planner's floor): every GPU of the
    planner's catalog is found in it by its device name, with the same peak."""
    from loom.plan.hardware import GPUS

    assert set(GPUS) == set(CATALOG_DEVICE_NAMES), "name a device for the new catalog entry"
    for key, gpu in GPUS.items():
        found = flops.catalog_peak(CATALOG_DEVICE_NAMES[key])
        assert found is not None and found[1] == gpu.peak_flops, key


# ---------------------------------------------------------------- timer, memory


def test_step_timer_computes_tokens_per_second_and_mfu() -> None:
    timer = StepTimer(flops_per_token=1e6, peak_flops=1e12, n_devices=4)
    timer.start()
    time.sleep(0.01)
    t = timer.stop(tokens=2048)
    assert t.step_time_s >= 0.01
    assert t.tokens_per_s == pytest.approx(2048 / t.step_time_s)
    assert t.mfu == pytest.approx(1e6 * t.tokens_per_s / (1e12 * 4))
    assert set(t.as_dict()) == {"step_time_s", "tokens_per_s", "mfu"}
    with pytest.raises(RuntimeError):
        timer.stop(tokens=1)
    unknown = StepTimer(flops_per_token=1e6, peak_flops=None)  # no stated peak: MFU n/a
    unknown.start()
    assert unknown.stop(tokens=10).as_dict()["mfu"] is None


def test_cpu_peak_memory_is_a_positive_byte_count() -> None:
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20  # torch alone is > 10 MiB RSS


# ---------------------------------------------------------------- logger


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logger_writes_jsonl_tensorboard_and_plain_lines(tmp_path) -> None:
    out = io.StringIO()  # not a TTY: plain lines every log_every steps
    log = MetricsLogger(tmp_path / "run", is_main=True, total_steps=4, log_every=2, stream=out)
    for step in range(1, 5):
        log.log_step(step, {"loss": 4.0 - 0.5 * step, "grad_norm": 1.0, "lr": 3e-4,
                            "tokens_per_s": 1000.0, "mfu": 0.25, "peak_mem_bytes": 2**30,
                            "nan_metric": float("nan"), "tensor": torch.tensor(2.5)})
        assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == step  # flushed per line
    log.log_eval(4, {"loss": 2.2})
    log.log_text("hello")
    png = log.close()
    log.close()  # idempotent

    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4]
    assert records[0]["loss"] == 3.5 and records[0]["lr"] == 3e-4
    assert records[0]["nan_metric"] is None and records[0]["tensor"] == 2.5
    assert records[-1]["val/loss"] == 2.2 and "loss" not in records[-1]
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 2/4", "step 4/4", "eval step 4",
                                                        "hello"]
    assert "mfu 25.0%" in lines[0] and "tok/s 1,000" in lines[0]
    assert png == tmp_path / "run" / "loss_curve.png" and png.read_bytes()[:8] == PNG_MAGIC


def test_logger_progress_bar_on_a_tty(tmp_path) -> None:
    out = _Tty()
    with MetricsLogger(tmp_path, is_main=True, total_steps=3, tensorboard=False,
                       stream=out) as log:
        for step in range(1, 4):
            log.log_step(step, {"loss": 1.0, "tokens_per_s": 5.0, "mfu": 0.1})
        log.log_text("note")
    text = out.getvalue()
    assert "3/3" in text and "note" in text and "loss 1" in text


def test_non_main_rank_writes_nothing(tmp_path) -> None:
    out = io.StringIO()
    log = MetricsLogger(tmp_path / "run", is_main=False, total_steps=2, stream=out)
    log.log_step(1, {"loss": 1.0})
    log.log_eval(1, {"loss": 1.0})
    log.log_text("x")
    assert log.close() is None
    assert not (tmp_path / "run").exists() and out.getvalue() == ""


def test_missing_tensorboard_warns_once_and_continues(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(metrics, "_TB_WARNED", False)
    with pytest.warns(UserWarning, match="TensorBoard"):
        a = MetricsLogger(tmp_path / "a", is_main=True, total_steps=1, progress=False)
    a.log_step(1, {"loss": 1.0})
    a.close(plot=False)
    b = MetricsLogger(tmp_path / "b", is_main=True, total_steps=1, progress=False)  # no warning
    b.close()
    assert read_jsonl(tmp_path / "a" / "metrics.jsonl")[0]["loss"] == 1.0
    assert not (tmp_path / "a" / "tb").exists()


def test_mfu_without_a_peak_is_null_and_shown_na(tmp_path) -> None:
    out = io.StringIO()
    with MetricsLogger(tmp_path, is_main=True, total_steps=1, tensorboard=False,
                       stream=out) as log:
        log.log_step(1, {"loss": 1.0, "mfu": None})
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["mfu"] is None
    assert out.getvalue() == "step 1/1 | loss 1 | mfu n/a\n"


def test_mfu_above_100_percent_is_never_published(tmp_path) -> None:
    """MFU > 1 means the stated peak is too low: that step and every later one log null, the
    line says why, and the warning comes once."""
    out = io.StringIO()
    with MetricsLogger(tmp_path, is_main=True, total_steps=4, tensorboard=False, stream=out,
                       peak_flops=2e9) as log:
        for step, mfu in enumerate([0.5, 1.7, 3.0, 0.9], start=1):
            log.log_step(step, {"loss": 1.0, "mfu": mfu})
    assert [r["mfu"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0.5, None, None, None]
    text = out.getvalue()
    warnings_ = [line for line in text.splitlines() if line.startswith("warning:")]
    assert len(warnings_) == 1, text
    assert "170%" in warnings_[0] and "0.002 TFLOP/s" in warnings_[0]
    assert "metrics.peak_tflops" in warnings_[0]
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert "mfu 50.0%" in steps[0]
    assert all("mfu n/a (peak too low)" in line for line in steps[1:])
    assert not any("%" in line for line in steps[1:])


class _Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(scalars)))

    def close(self) -> None:
        self.closed = True


def test_trackers_get_the_scalars_tensorboard_gets(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = _Recorder()
    log = MetricsLogger(tmp_path, is_main=True, total_steps=2, progress=False,
                        trackers=[tracker])
    log.log_step(1, {"loss": 2.0, "mfu": None, "comm/dp/all_reduce_bytes": 8, "note": "x"})
    log.log_eval(1, {"loss": 2.5})
    log.log_step(2, {"loss": 1.5, "lr": 1e-3})
    log.close(plot=False)
    assert tracker.closed
    assert tracker.logged == [(1, {"train/loss": 2.0, "comm/dp/all_reduce_bytes": 8}),
                              (1, {"val/loss": 2.5}), (2, {"train/loss": 1.5, "train/lr": 1e-3})]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tb = {(e.step, tag, e.value) for tag in events.Tags()["scalars"]
          for e in events.Scalars(tag)}
    ours = {(step, tag, float(torch.tensor(value, dtype=torch.float32)))  # TB keeps float32
            for step, scalars in tracker.logged for tag, value in scalars.items()}
    assert tb == ours
    quiet = _Recorder()  # a non-main rank never logs to a tracker
    other = MetricsLogger(tmp_path / "other", is_main=False, total_steps=1, trackers=[quiet])
    other.log_step(1, {"loss": 1.0})
    other.close()
    assert quiet.logged == [] and not quiet.closed


@pytest.mark.parametrize("seconds, shown", [
    (0, "0s"), (0.4, "0s"), (44.6, "45s"), (59.4, "59s"), (60, "1m00s"), (185, "3m05s"),
    (3599, "59m59s"), (3600, "1h00m"), (7620, "2h07m"), (86399, "23h59m"), (86400, "1d00h"),
    (273600, "3d04h"), (-5, "0s"),
])
def test_eta_formatting(seconds: float, shown: str) -> None:
    assert format_eta(seconds) == shown


def test_eta_is_remaining_steps_times_a_smoothed_step_time() -> None:
    pace = StepPace(alpha=0.5)
    pace.update(1, 100.0)  # the first step only starts the clock (start-up is not a step)
    assert pace.eta(10) is None
    pace.update(2, 102.0)  # 2 s per step
    assert pace.eta(10) == 20.0
    pace.update(4, 110.0)  # 4 s per step over two steps: smoothed to 3
    assert pace.eta(10) == 30.0
    pace.update(4, 500.0)  # the same step again changes nothing
    assert pace.eta(2) == 6.0 and pace.eta(0) == 0.0


def test_the_progress_line_shows_the_eta(tmp_path, monkeypatch) -> None:
    clock = iter([10.0, 13.0, 16.0])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    with MetricsLogger(tmp_path, is_main=True, total_steps=100, tensorboard=False,
                       jsonl=False, stream=out) as log:
        for step in (1, 2, 3):
            log.log_step(step, {"loss": 1.0})
    lines = out.getvalue().splitlines()
    assert "eta" not in lines[0]  # one step tells nothing about the pace
    assert lines[1].endswith("| eta 4m54s") and lines[2].endswith("| eta 4m51s")  # 98 x 3 s


# ---------------------------------------------------------------- plots


def write_jsonl(path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("with_val", [False, True])
@pytest.mark.parametrize("n_steps", [10, 300])
def test_loss_curve_png(tmp_path, with_val: bool, n_steps: int) -> None:
    records = [{"step": s, "loss": 5.0 * math.exp(-s / 80) + 0.1 * math.sin(s)}
               for s in range(1, n_steps + 1)]
    if with_val:
        records += [{"step": s, "val/loss": 5.0 * math.exp(-s / 80) + 0.2}
                    for s in range(0, n_steps + 1, max(1, n_steps // 5))]
    write_jsonl(tmp_path / "metrics.jsonl", records)
    out = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "loss.png")
    assert out == tmp_path / "plots" / "loss.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in out.parent.iterdir()] == ["loss.png"]  # no temp file left behind


def test_loss_curve_without_loss_values_is_an_error(tmp_path) -> None:
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "lr": 1e-3}])
    with pytest.raises(ValueError, match="no 'loss'"):
        plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
