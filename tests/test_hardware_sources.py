"""Where the planner's hardware numbers come from: every preset's numbers name a source; the planner's fields measured
on a device (colozoo.cost.measure, here on the CPU at tiny sizes) load as a preset that names the device they ran on
and plan; the tile fit recovers the tile a grid was made with."""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from colozoo.cost.hardware import PRESETS, Hardware, HardwareError, get_hardware, unsourced, with_all_sources
from colozoo.cost.measure import Sizes, datasheet_preset, fit_small_tile, measure, modelled_rate, write_measured

TINY = Sizes(64, (8, 48), (16, 96), 32, 1 << 16, 1 << 16, (1, 1, 32, 16), 0.05, sample_s=0.001)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_number_of_a_preset_names_its_source(name):
    hw = PRESETS[name]
    assert unsourced(hw) == []
    assert hw.sources["peak_flops"].startswith("NVIDIA") and hw.sources["gpu_memory"].startswith("NVIDIA")


def test_a_default_source_is_not_attached_to_another_value():
    hw = with_all_sources(Hardware("x", 1.0, 1.0, intra_node_bw=7.0, sources={"gpu_memory": "a", "peak_flops": "b"}))
    assert unsourced(hw) == ["intra_node_bw"]
    assert "estimate" in hw.sources["matmul_efficiency"]


def test_show_hardware_prints_each_number_with_its_source(capsys):
    from colozoo.cli import main

    assert main(["plan", "--show-hardware", "--hardware", "a100-80gb", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A100-80GB: 8 GPUs a node x 2 node(s)")
    assert "312 TFLOP/s  NVIDIA A100 datasheet: 312 TFLOP/s dense BF16" in out and "(no source)" not in out
    speed = next(line for line in out.splitlines() if line.startswith("attention_speed"))
    assert "measured series" in speed and "flash2/d64" not in out  # the table's series, not their numbers
    assert main(["plan", "--show-hardware", "--set", "inter_node_bw=1e11", "--gpu-memory", "40GB"]) == 0
    given = [line for line in capsys.readouterr().out.splitlines() if "given by the caller" in line]
    assert [line.split()[0] for line in given] == ["gpu_memory", "inter_node_bw"]


def test_an_override_of_none_is_a_value_or_refused():
    """sm_count takes None (no wave quantization): given, it is set; a field that takes a number refuses None (it
    was dropped as "not given", the preset's 0.711 kept); an unknown field is refused by name."""
    hw = get_hardware("H100-80GB", sm_count=None)
    assert hw.sm_count is None and "given by the caller" in hw.sources["sm_count"]
    assert get_hardware("H100-80GB").sm_count == 132  # the H100 SXM5 whitepaper's SMs
    with pytest.raises(HardwareError, match=r"matmul_efficiency=None\): matmul_efficiency takes a number"):
        get_hardware("H100-80GB", matmul_efficiency=None)
    with pytest.raises(HardwareError, match="no field 'matmul_eficiency'"):
        get_hardware("H100-80GB", matmul_eficiency=0.5)


def test_datasheet_presets_by_device_name():
    names = {"NVIDIA H100 80GB HBM3": "H100-80GB", "NVIDIA H200": "H200", "NVIDIA A100-SXM4-40GB": "A100-40GB",
             "NVIDIA A100-SXM4-80GB": "A100-80GB", "NVIDIA H100 PCIe": None, "NVIDIA H100 NVL": None,
             "Tesla V100-SXM2-32GB": "V100-32GB", "NVIDIA GeForce RTX 4090": "RTX4090", "AMD Instinct MI300X": None,
             "NVIDIA GH200 480GB": None, "NVIDIA H800": "H800", "NVIDIA B200": "B200", "NVIDIA GB200": None}
    assert {name: datasheet_preset(name) for name in names} == names


def test_the_tile_fit_recovers_the_small_tile_a_grid_was_made_with():
    hw = PRESETS["H100-80GB"]
    rows = [{"m": m, "n": n, "k": 4096} for m in (256, 1024, 4096) for n in (1536, 4096, 6144)]
    for tile, rate in (((128, 64), 0.8), ((64, 64), 0.9), ((128, 128), 0.95)):
        made = [{**r, "flops_per_s": modelled_rate(r, hw.with_(small_tile=tile, small_tile_efficiency=rate), 2)}
                for r in rows]
        assert fit_small_tile(made, hw, 2) == (tile, rate, pytest.approx(0.0, abs=1e-12))


def test_measured_on_the_cpu_it_names_the_cpu_loads_as_a_preset_and_plans(tmp_path, capsys):
    found = measure("cpu", sizes=TINY)
    path = write_measured(tmp_path / "cpu.json", found)
    hw = get_hardware(str(path), gpus=1)
    assert hw.name.startswith("cpu") and "GB" not in hw.name.split(",")[0]  # no GPU's name on a CPU's figures
    assert hw.peak_flops == found["peak_flops"] < 1e14 and hw.sm_count is None and hw.matmul_efficiency > 0
    measured = [k for k in found if k not in ("preset", "name", "sources", "evidence")]
    assert {"peak_flops", "hbm_bw", "matmul_efficiency", "attention_efficiency", "kernel_floor_s"} <= set(measured)
    for key in measured:
        assert hw.sources[key].startswith("measured by colozoo.cost.measure on cpu"), key
    assert unsourced(hw) == [] and "datasheet" in hw.sources["intra_node_bw"]  # the links stay the preset's
    assert hw.attention_speed == {}  # attention priced by what was measured, not the links preset's paper table
    import os  # the machine's memory, read apart from measure (POSIX): not the links preset's H100 80 GB
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert hw.gpu_memory == found["gpu_memory"] == pytest.approx(machine, rel=0.01) and machine != 80 * 2**30
    assert len(found["evidence"]["gemm_grid"]) == 4 and all(r["of_peak"] > 0 for r in found["evidence"]["gemm_grid"])
    from colozoo.cli import main

    args = ["plan", "opt-125m", "--gpus", "1", "--seq-len", "64", "--global-batch", "1", "--json", "--top", "1"]
    assert main(args + ["--hardware", str(path)]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["hardware"]["peak_flops"] == found["peak_flops"] and planned["plans"]


def test_against_a_datasheet_the_efficiencies_are_of_its_peaks(tmp_path):
    """Forced onto a datasheet preset, a device's rates are fractions of its peak and bandwidth, which stay the
    datasheet's; the file still names the device that ran."""
    found = measure("cpu", preset="A100-80GB", sizes=TINY)
    assert "peak_flops" not in found and found["name"].startswith("A100-80GB measured on cpu")
    seen = found["evidence"]
    assert math.isclose(found["matmul_efficiency"], seen["sustained_flops_per_s"] / 312e12)
    assert math.isclose(found["hbm_efficiency"], seen["copy_bytes_per_s"] / 2039e9)  # the datasheet's 2,039 GB/s


def test_the_gpu_bench_writes_the_preset_file(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu
    import torch

    args = gpu.argparse.Namespace(hardware_out=tmp_path / "hw.json")
    line = gpu.hardware_case(args, torch.device("cpu"))
    written = json.loads((tmp_path / "hw.json").read_text())
    assert line["metrics"]["preset_file"] == str(tmp_path / "hw.json") and line["ratio"] is None
    assert written["sources"]["matmul_efficiency"].startswith("measured by bench/gpu.py on cpu")


def test_newer_presets_keep_their_datasheet_links():
    """H800: the H100 with half its NVLink; B200: 8 a node; GB200 NVL72: a 64-rank group stays on NVLink, where on
    B200s it leaves for the network adapter."""
    from colozoo.cost.network import collective_seconds

    h100, h800 = get_hardware("H100-80GB", gpus=16), get_hardware("H800", gpus=16)
    assert h800.peak_flops == h100.peak_flops and h800.intra_node_bw == h100.intra_node_bw / 2.25
    b200, gb200 = get_hardware("B200", gpus=144), get_hardware("GB200-NVL72", gpus=144)
    assert (b200.gpus_per_node, b200.nodes, gb200.gpus_per_node, gb200.nodes) == (8, 18, 72, 2)
    on_b200, on_gb200 = (collective_seconds(hw, "all_gather", 1e9, 64, 64, 1) for hw in (b200, gb200))
    assert on_gb200 == pytest.approx(63 / 64 * 1e9 / gb200.bandwidth("all_gather", 64))
    assert on_gb200 < on_b200 / 10


LENT_H200 = Path(__file__).resolve().parents[1] / "bench" / "measured" / "H200-2026-11-29.json"


def test_the_h200_measured_on_a_lent_gpu_loads_and_its_preset_cites_it():
    """The file bench/gpu.py wrote on a lent H200 plans as it is (`colozoo plan --hardware` it), and the H200 preset's
    copy efficiency is that file's, naming it."""
    measured, preset = get_hardware(str(LENT_H200)), PRESETS["H200"]
    assert measured.name == "H200 measured on NVIDIA H200" and measured.peak_flops == preset.peak_flops
    evidence = json.loads(LENT_H200.read_text())["evidence"]
    assert evidence["sustained_flops_per_s"] < evidence["burst_flops_per_s"] < preset.peak_flops
    assert preset.hbm_efficiency == pytest.approx(measured.hbm_efficiency, abs=5e-4)
    assert LENT_H200.name in preset.sources["hbm_efficiency"] and LENT_H200.name in preset.sources["matmul_efficiency"]


def test_tile_and_wave_quantization_explain_the_h200s_products():
    """On the lent H200's grid (m 512-8192 x n 1536-6144 x k 8192 in bf16, bursts) the shape model prices every
    product within 14% with the large tile and the small one fitted beside it (the presets' default); on the large
    tile alone the smallest product, 512 x 1536, runs 3.2x faster than priced."""
    data = json.loads(LENT_H200.read_text())
    rows, burst = data["evidence"]["gemm_grid"], data["evidence"]["burst_flops_per_s"]
    at_burst = replace(PRESETS["H200"], matmul_efficiency=burst / PRESETS["H200"].peak_flops)
    tile, rate, error = fit_small_tile(rows, at_burst, itemsize=2)
    assert (tile, rate) == (tuple(data["small_tile"]), data["small_tile_efficiency"]) == (at_burst.small_tile, 0.92)
    assert error < 0.06
    ratios = [r["flops_per_s"] / modelled_rate(r, at_burst, 2) for r in rows]
    assert all(0.86 < ratio < 1.14 for ratio in ratios), ratios
    smallest = min(rows, key=lambda r: r["m"] * r["n"])
    assert smallest["flops_per_s"] / modelled_rate(smallest, replace(at_burst, small_tile=None), 2) > 3
