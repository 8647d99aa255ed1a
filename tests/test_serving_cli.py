"""`tritium serve` as a user runs it: a child process that starts tritonserver, prints the
endpoints, answers `tritium generate --url`, and stops on SIGINT / SIGTERM leaving no process."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow
CHAT = "<|im_start|>user\nName a French cheese, with its accent.<|im_end|>\n<|im_start|>assistant\n"


def _descendants(pid: int) -> set:
    """All live descendants of pid, from /proc."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _serve(args, env, timeout=900):
    """Start `tritium serve ARGS`; return (process, grpc_url, http_url) once it prints readiness."""
    proc = subprocess.Popen([sys.executable, "-m", "tritium.client.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout
    lines, urls = [], None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"HTTP http://(\S+)\s+gRPC (\S+)", line)
        if m:
            urls = m.group(2), m.group(1)
        if urls and line.startswith("Ctrl-C stops"):  # after the OpenAI API's lines
            proc.lines = lines
            return (proc,) + urls
    proc.kill()
    raise AssertionError("tritium serve never became ready:\n" + "".join(lines[-30:]))


def _stop(proc, sig):
    kids = _descendants(proc.pid)
    assert kids, "tritium serve started no tritonserver"
    proc.send_signal(sig)
    rc = proc.wait(60)
    proc.stdout.close()
    time.sleep(0.5)
    assert rc == 0
    assert not [k for k in kids if _alive(k)], "a tritonserver / stub process outlived tritium serve"


def test_serve_repo_generate_and_sigint(tiny_engine, tmp_path, capsys):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    from tritium.builder.repository import write_repository
    from tritium.client.cli.main import main
    engine = tiny_engine("llama")
    repo = str(tmp_path / "repo")
    write_repository(repo, "tiny", engine)
    proc, grpc_url, http_url = _serve(["--repo", repo, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                                       "--openai-port", "-1", "--log-file", str(tmp_path / "log.txt")], dict(os.environ))
    try:
        prompt = "naïve café — 日本語"
        ref = LLMEngine(engine).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
        capsys.readouterr()
        assert main(["generate", "--url", grpc_url, "--model", "tiny", "--stream", "--max-tokens", "12", prompt]) == 0
        assert capsys.readouterr().out == ref.text + "\n"
        assert main(["generate", "--url", http_url, "--protocol", "http", "--model", "tiny_bls", "--stream",
                     "--max-tokens", "12", prompt]) == 0
        assert capsys.readouterr().out == ref.text + "\n"
    finally:
        _stop(proc, signal.SIGINT)


def test_readme_main_command_serves_smollm2(smollm2_gguf, tmp_path, capsys):
    """`tritium serve` with no --repo on a fresh cache: builds SmolLM2 once, serves it; a streamed
    `tritium generate --url` equals in-process greedy generation on the same engine."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    from tritium.client.cli.main import main
    env = dict(os.environ, TRITIUM_CACHE=str(tmp_path / "cache"), TRITIUM_SMOLLM2_GGUF=smollm2_gguf)
    proc, grpc_url, _ = _serve(["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                                "--openai-port", "0"], env)
    try:
        # The printed curl hint is a chat request that SmolLM2 answers correctly, through the OpenAI API.
        hint = next(ln for ln in proc.lines if ln.startswith("try: curl"))
        url = re.search(r"curl -s (\S+)", hint).group(1)
        body = re.search(r"-d '(.*)'$", hint.strip()).group(1)
        req = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        engine = os.path.join(tmp_path, "cache", "engines", "smollm2-135m-instruct")
        ref = LLMEngine(engine).generate([CHAT], SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0]
        assert ref.text.strip()
        capsys.readouterr()
        assert main(["generate", "--url", grpc_url, "--model", "smollm2", "--stream", "--max-tokens", "16",
                     CHAT]) == 0
        assert capsys.readouterr().out == ref.text + "\n"
        assert main(["generate", "--url", grpc_url, "--model", "smollm2_ensemble", "--stream", "--max-tokens", "16",
                     CHAT]) == 0
        assert capsys.readouterr().out == ref.text + "\n"
    finally:
        _stop(proc, signal.SIGTERM)


def test_serve_reports_a_failed_load_in_one_line(tmp_path):
    from tritium.builder.repository import llm_config
    os.makedirs(tmp_path / "repo" / "m" / "1")
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text(llm_config("m", str(tmp_path / "missing"), 4))
    r = subprocess.run([sys.executable, "-m", "tritium.client.cli", "serve", "--repo", str(tmp_path / "repo"),
                        "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "-1",
                        "--log-file", str(tmp_path / "log.txt")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("failed to load 'm' version 1:"))
    assert "tritium: cannot load engine" in line and f"engine_dir {tmp_path / 'missing'} does not exist" in line
