"""`python -m card.client.bench.gpu` (the benchmark half of `make gpu-check`) end to end on the CPU
at tiny shapes: the roofline share of every serving figure, the bandwidth's source, and the
transformers peer beside ours; and the pieces those rest on, at the real shapes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from card.client.bench import gpu

SMOKE = ["--device", "cpu", "--small", "--new-tokens", "4", "--context", "16", "--speculation", "never",
         "--decode-steps", "eager,static"]


@pytest.mark.slow
def test_gpu_check_on_the_cpu_reports_roofline_and_peer(tmp_path):
    out = tmp_path / "gpu-check.json"
    run = subprocess.run([sys.executable, "-m", "card.client.bench.gpu", *SMOKE, "--in-flight", "1,2",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert report["bandwidth"]["source"].startswith("measured")
    assert report["bandwidth"]["bytes_per_s"] > 0
    # the keys earlier runs wrote, with their meaning, and the new ones beside them
    assert set(report["serving"]) == {f"{k}{s}/{m}/{n}" for k in ("exact", "vendor") for s in ("", "+static")
                                      for m in ("vanilla", "card") for n in (1, 2)}
    for key, row in report["serving"].items():  # the step each ran with, and exact beside vendor
        assert row["decode_step"] == ("static" if "+static" in key else "eager"), key
        assert (row["vs_vendor"] > 0) if key.startswith("exact") else ("vs_vendor" not in row), key
    for key, row in report["serving"].items():
        assert row["tok_s"] > 0 and row["vs_vanilla"] > 0, key
        assert row["roofline"] > 0 and math.isfinite(row["roofline"]), key
        assert row["vs_peer"] > 0, key
        assert row["bytes_per_step"] >= report["read_bytes"]["weight_bytes"], key
    peer = report["peer"]
    assert peer["compile_error"] is None, peer["compile_error"]
    assert "torch.compile" in peer["what"] and peer["attention"] == "sdpa"
    assert set(peer["batches"]) == {"1", "2"}
    for n, row in peer["batches"].items():
        assert row["compiled"] and row["tok_s"] > 0 and row["new_tokens"] == 4 * int(n)
        assert row["warmup_s"] > 0 and row["compile_s"] >= 0
        assert row["roofline"] > 0 and math.isfinite(row["roofline"])
        for kernels, ratio in row["ours_vs_peer"].items():
            assert ratio == pytest.approx(report["serving"][f"{kernels}/vanilla/{n}"]["tok_s"] / row["tok_s"])
    figures = [line for line in run.stdout.splitlines() if "tok/s" in line or line.endswith("ms  [cpu]")]
    assert set(report["forward_ms"]) == {"exact", "exact+static", "vendor", "vendor+static"}
    assert len(figures) == 16 + 2 + 4, run.stdout  # serving rows (two steps), peer rows, forward sweeps
    assert all(line.endswith("[cpu]") for line in figures), run.stdout


def test_peer_runs_eager_and_says_why_when_compile_fails(tmp_path, monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler on this device")

    monkeypatch.setattr(torch, "compile", no_compiler)  # what transformers' generate calls to compile
    out = tmp_path / "gpu-check.json"
    result = CliRunner().invoke(gpu.main, [*SMOKE, "--kernels", "vendor", "--in-flight", "1,2",
                                           "--bandwidth-gbs", "100", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["bandwidth"] == {"bytes_per_s": 100e9, "source": "--bandwidth-gbs"}
    peer = report["peer"]
    assert "no compiler on this device" in peer["compile_error"]
    assert "eager" in peer["what"] and "torch.compile failed" in peer["what"]
    assert [row["compiled"] for row in peer["batches"].values()] == [False, False]
    assert all(row["tok_s"] > 0 for row in peer["batches"].values())
    assert "torch.compile failed: RuntimeError: no compiler on this device" in result.output


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H200", 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 2.04e12), ("NVIDIA A100-SXM4-40GB", 1.555e12),
    ("NVIDIA A100-PCIE-40GB", 1.555e12), ("NVIDIA L4", 3.0e11), ("NVIDIA A10", 6.0e11),
    ("NVIDIA L40S", 8.64e11), ("NVIDIA GeForce RTX 4090", 1.008e12),
])
def test_bandwidth_of_known_devices(name, peak):
    limit = gpu.bandwidth("cuda", name, None)
    assert limit["bytes_per_s"] == peak and limit["source"].startswith("table")
    assert gpu.bandwidth("cuda", name, 1000.0) == {"bytes_per_s": 1e12, "source": "--bandwidth-gbs"}


def test_bandwidth_of_an_unknown_device_is_measured():
    # an A100 80GB PCIe (1.935e12) is not in the table: matching it to the SXM part would be wrong
    assert not any(gpu.re.search(p, "NVIDIA A100 80GB PCIe", gpu.re.IGNORECASE) for p, _, _ in gpu.BANDWIDTH)
    limit = gpu.bandwidth("cpu", "cpu", None)
    assert limit["source"].startswith("measured") and limit["bytes_per_s"] > 0


def test_read_bytes_at_the_target_shape():
    """Qwen2.5-1.5B: 1.54e9 parameters in bf16, the embedding (tied: the LM head) once; 28 layers x
    2 KV heads x 128 dims x K and V x 2 bytes a token."""
    sizes = gpu.read_bytes(gpu.TARGET)
    assert sizes == {"weight_bytes": 3_087_428_608, "kv_bytes_per_token": 28 * 2 * 128 * 2 * 2}


def test_roofline_arithmetic():
    sizes = {"weight_bytes": 1000, "kv_bytes_per_token": 10}
    # 2 forwards, 2 sessions of 2 forwards and 4 new tokens each: mean history 128 + 2 tokens
    got = gpu.roofline(2, [2, 2], [4, 4], 0.5, sizes, 1e4)
    read = 2 * 1000 + 2 * 2 * 130 * 10
    assert got["roofline"] == pytest.approx(read / 0.5 / 1e4)
    assert got["bytes_per_step"] == read / 2 and got["step_ms"] == 250
