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
from loom.train.flops import device_peak_flops, measure_matmul_peak
from loom.train.metrics import MetricsLogger, StepTimer, peak_memory_bytes
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


def test_measured_cpu_peak_is_positive_and_finite() -> None:
    rate = measure_matmul_peak(torch.device("cpu"), torch.float32, size=256, seconds=0.05)
    assert math.isfinite(rate) and rate > 1e8  # any CPU does > 0.1 GFLOP/s in fp32 matmul
    peak, source = device_peak_flops(torch.device("cpu"), torch.float32)
    assert source == "measured" and math.isfinite(peak) and peak > 0
    t0 = time.perf_counter()
    assert device_peak_flops(torch.device("cpu"), torch.float32) == (peak, source)
    assert time.perf_counter() - t0 < 0.05  # cached, not measured again


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA H200", 989e12), ("NVIDIA B200", 2.25e15), ("AMD Instinct MI300X", 1300e12),
    ("AMD Instinct MI250X", 383e12), ("NVIDIA RTX A6000", 154.85e12), ("NVIDIA L40S", 362e12),
])
def test_known_gpu_peaks_come_from_the_table(monkeypatch: pytest.MonkeyPatch, name: str,
                                            peak: float) -> None:
    monkeypatch.setattr(flops, "_PEAK_CACHE", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_flops(torch.device("cuda"), torch.bfloat16) == (peak, f"table:{name}")


def test_unknown_gpu_or_fp32_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flops, "_PEAK_CACHE", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda device, dtype: 1.5e12)
    assert device_peak_flops(torch.device("cuda"), torch.float32) == (1.5e12, "measured")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9000")
    assert device_peak_flops(torch.device("cuda"), torch.bfloat16) == (1.5e12, "measured")


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
