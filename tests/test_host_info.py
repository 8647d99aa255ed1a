"""The benchmarks' host report (client/bench/host_info.py) and the ISA plumbing of `tritium compare`
(llama.cpp cmake options per forced ISA, Tritium's path forced to match): what is printed and
recorded, not how fast anything is."""
from __future__ import annotations

import os

import pytest

from tritium.client.bench import host_info
from tritium.client.bench.llamacpp import cmake_flags, ensure_llama_cpp
from tritium.client.cli.main import main
from tritium.kernels import cpu_isa, cpu_native


def test_host_report_names_model_isa_cores_and_bandwidth():
    rep = host_info.host_report(1, 8)
    assert rep["cpu_model"] and rep["usable_cores"] >= 1 and rep["logical_cores"] >= rep["usable_cores"]
    assert rep["isa_path"] == cpu_native.isa() and rep["isa_paths_runnable"] == cpu_isa.runnable()
    mem = rep["memory"]
    assert mem["threads"] == 1 and mem["buffer_mb"] == 8 and mem["read_gbs"] > 0 and mem["copy_gbs"] > 0
    line = host_info.format_host(rep)
    assert line.startswith("host: " + rep["cpu_model"]) and f"ISA path {rep['isa_path']}" in line
    assert f"{rep['usable_cores']} of {rep['logical_cores']} cores" in line and "GB/s (1 threads, 8 MB)" in line
    assert "memory" not in host_info.host_report(1, 0)  # 0 skips the measurement


def test_read_bandwidth_is_the_faster_page_placement(monkeypatch):
    """read_gbs is the faster of the 4 KiB and the 2 MiB-page read (the host's limit); with huge
    pages off (TRITIUM_HUGE_PAGES=0) only the 4 KiB read is taken and the line says nothing of pages."""
    from tritium.kernels import hugepages
    mem = host_info.memory_bandwidth(1, 8)
    assert mem["read_gbs_4k"] > 0
    if hugepages.thp_mode() in ("always", "madvise"):
        assert mem["read_gbs_huge"] and mem["read_gbs_huge"] > 0
        assert "on 4 KiB pages" in host_info.format_host(dict(host_info.host_report(1, 0), memory=mem))
    assert mem["read_gbs"] == max(mem["read_gbs_4k"], mem["read_gbs_huge"] or 0.0)
    monkeypatch.setenv(hugepages.ENV, "0")
    off = host_info.memory_bandwidth(1, 8)
    assert off["read_gbs_huge"] is None and off["read_gbs"] == off["read_gbs_4k"]
    assert "pages" not in host_info.format_host(dict(host_info.host_report(1, 0), memory=off))


def test_forced_path_is_reported(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV, "generic")  # every host runs the portable path
    cpu_native.reset()
    try:
        rep = host_info.host_report(1, None)
        assert rep["isa_path"] == "generic" and rep["isa_forced"] == "generic"
        assert "ISA path generic (forced by TRITIUM_CPU_ISA)" in host_info.format_host(rep)
    finally:
        monkeypatch.delenv(cpu_isa.ENV)
        cpu_native.reset()


def test_bandwidth_limit_and_engine_bytes(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.safetensors").write_bytes(b"x" * 500)
    (tmp_path / "engine.json").write_text("{}")
    assert host_info.engine_weight_bytes(str(tmp_path)) == 1500
    assert host_info.bandwidth_limit_tok_s(30.0, 150_000_000) == pytest.approx(200.0)
    assert host_info.bandwidth_limit_tok_s(30.0, 0) is None


def test_llama_cpp_cmake_flags_per_isa():
    assert "-DGGML_NATIVE=ON" in cmake_flags("native")
    avx2 = cmake_flags("avx2")
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DGGML_AVX2=ON" in avx2 and "-DGGML_FMA=ON" in avx2
    assert "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX512_BF16=OFF" in avx2
    avx512 = cmake_flags("avx512")
    assert "-DGGML_AVX512=ON" in avx512 and "-DGGML_AVX512_VNNI=ON" in avx512 and "-DGGML_AVX512_BF16=ON" in avx512
    generic = cmake_flags("generic")
    assert "-DGGML_NATIVE=OFF" in generic and not [f for f in generic if f.startswith("-DGGML_") and f.endswith("=ON")]
    for flags in (avx2, avx512, generic):
        assert "-DLLAMA_BUILD_SERVER=ON" in flags
    with pytest.raises(ValueError, match="--isa"):
        cmake_flags("avx9")


def test_forced_isa_llama_dir_without_that_build_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITIUM_LLAMA_CPP_DIR", raising=False)
    (tmp_path / "build" / "bin").mkdir(parents=True)
    for name in ("llama-server", "llama-quantize"):
        f = tmp_path / "build" / "bin" / name
        f.write_text("#!/bin/sh\n")
        f.chmod(0o755)
    assert ensure_llama_cpp(str(tmp_path)) == str(tmp_path)  # the native build is there
    with pytest.raises(ValueError, match="build-avx2/bin/llama-server") as e:
        ensure_llama_cpp(str(tmp_path), isa="avx2")
    assert "-DGGML_AVX2=ON" in str(e.value)


def test_compare_isa_forces_tritium_path(monkeypatch):
    from tritium.client.cli.compare_cli import apply_isa
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    try:
        apply_isa("generic")
        assert os.environ[cpu_isa.ENV] == "generic" and cpu_native.isa() == "generic"
    finally:
        os.environ.pop(cpu_isa.ENV, None)
        cpu_native.reset()
    apply_isa("native")
    assert cpu_isa.ENV not in os.environ


@pytest.mark.parametrize("argv,flag", [(["--isa", "avx9"], "--isa"), (["--bandwidth-mb", "-1"], "--bandwidth-mb")])
def test_compare_bad_isa_flags_exit_2(capsys, argv, flag):
    rc = main(["compare", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_prints_the_host_first(capsys):
    import sys

    from tritium.client.cli.bench_cli import print_result
    host = host_info.host_report(1, 8)
    host.update(engine_weight_bytes=270_000_000, bandwidth_limit_tok_s=100.0)
    print_result({"host": host, "workload": {"num_requests": 1, "prompt_words": [1, 2], "output_tokens": [1, 2],
                                             "seed": 0, "single_stream": 0, "single_stream_tokens": 0},
                  "runs": {}, "ratios": {"reference": None}}, sys.stdout)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == host_info.format_host(host)
    assert out[1].startswith("single-stream limit of the in-process engine: 100 tok/s") and "270 MB" in out[1]


def test_isa_selection_and_errors(monkeypatch):
    """cpu_isa.select: the best runnable path unless TRITIUM_CPU_ISA forces one; an unknown value or
    a path the CPU cannot run is an error naming the variable and the allowed values."""
    avx2_only = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sse4_2"}
    if cpu_isa.is_x86():
        assert cpu_isa.runnable(avx2_only) == ["avx2", "generic"]
        assert cpu_isa.select({}, avx2_only) == "avx2"
        assert cpu_isa.select({cpu_isa.ENV: "generic"}, avx2_only) == "generic"
        with pytest.raises(ValueError, match=r"TRITIUM_CPU_ISA=avx512 cannot run .*avx512_bf16.*allowed values here: "
                                             r"avx2, generic"):
            cpu_isa.select({cpu_isa.ENV: "avx512"}, avx2_only)
        assert cpu_isa.runnable(set()) == ["generic"]
    with pytest.raises(ValueError, match="TRITIUM_CPU_ISA='sse9' is not a CPU path; allowed values: avx512, avx2, generic"):
        cpu_isa.select({cpu_isa.ENV: "sse9"})
    monkeypatch.setenv(cpu_isa.ENV, "sse9")  # the runtime refuses it too, whatever else holds
    cpu_native.reset()
    try:
        with pytest.raises(ValueError, match="TRITIUM_CPU_ISA"):
            cpu_native.available()
    finally:
        monkeypatch.delenv(cpu_isa.ENV)
        cpu_native.reset()
    assert cpu_native.isa() in (cpu_isa.runnable()[0], "none")  # unforced: the best path (or native off)
