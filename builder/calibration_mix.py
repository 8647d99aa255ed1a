"""The shipped text domains (builder/data/) and the default calibration mix drawn from them.

Calibration domains (PROVENANCE.json says where each file comes from, under which license):
- prose:    Python tutorial and HOWTO pages, as plain text;
- dialogue: the Python FAQ's questions and answers, one user/assistant conversation each,
            rendered in the source model's chat format (its chat template; `User:` / `Assistant:`
            lines when it has none);
- code:     Python standard-library source.
Held-out domains, never calibrated on (the build report and `tritium eval --domain` score them):
- kjv:      the King James Version's First Book of Samuel (narrative prose, 1611);
- devil:    Ambrose Bierce's "The Devil's Dictionary" (dictionary entries and verse, 1911).

The default mix draws round(weight * N) windows from each calibration domain (largest
remainders settle the rounding), at evenly spaced starts over that domain's tokens, so it is a
deterministic function of the shipped files, the tokenizer and the chat template.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

from tritium.backend.chat_template import ChatTemplate, read_template_source

from .calibration import default_eval_text

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
PROVENANCE_FILE = os.path.join(DATA_DIR, "PROVENANCE.json")
CALIBRATION_FILES = {"prose": "calibration/prose.txt", "dialogue": "calibration/dialogue.jsonl",
                     "code": "calibration/code.py.txt"}
CALIBRATION_WEIGHTS = {"prose": 0.4, "dialogue": 0.3, "code": 0.3}
HELD_OUT_FILES = {"kjv": "eval/kjv_1samuel.txt", "devil": "eval/devil.txt"}
HELD_OUT_DOMAINS = tuple(HELD_OUT_FILES)
# every name `tritium eval --domain` takes: the held-out domains, the calibration domains, and the
# former default evaluation text (stdlib docstrings, read from the running Python)
EVAL_DOMAINS = HELD_OUT_DOMAINS + tuple(CALIBRATION_FILES) + ("docstrings",)
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def data_path(rel: str) -> str:
    return os.path.join(DATA_DIR, rel)


def read_data(rel: str) -> str:
    with open(data_path(rel), encoding="utf-8") as f:
        return f.read()


def file_sha256(rel: str) -> str:
    with open(data_path(rel), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def dialogues() -> List[List[dict]]:
    """The dialogue domain's conversations: lists of {role, content} messages."""
    return [json.loads(line)["messages"] for line in read_data(CALIBRATION_FILES["dialogue"]).splitlines()
            if line.strip()]


def render_dialogue(messages: List[dict], chat_template=None) -> str:
    """One conversation as the model sees it: through its chat template (a
    backend.chat_template.ChatTemplate) when it has one, else 'Role: text' lines."""
    if chat_template is not None:
        return chat_template.render(messages, add_generation_prompt=False)
    return "".join(f"{PLAIN_ROLES.get(m['role'], m['role'].title())}: {m['content']}\n" for m in messages) + "\n"


def domain_text(domain: str, chat_template=None) -> str:
    """The text of a shipped domain (EVAL_DOMAINS); dialogue rendered with chat_template.
    Raises ValueError naming the allowed domains for an unknown one."""
    if domain not in EVAL_DOMAINS:
        raise ValueError(f"--domain {domain!r} is not a shipped domain; allowed: {', '.join(EVAL_DOMAINS)}")
    if domain == "docstrings":
        return default_eval_text()
    if domain == "dialogue":
        return "".join(render_dialogue(m, chat_template) for m in dialogues())
    return read_data(HELD_OUT_FILES.get(domain) or CALIBRATION_FILES[domain])


def allocate(num_samples: int, weights: Dict[str, float]) -> Dict[str, int]:
    """Samples per domain: floor(w * N) each, then one more to the largest remainders (ties in
    dict order), so the counts sum to N and follow the weights as closely as integers can."""
    total = sum(weights.values())
    exact = {d: num_samples * w / total for d, w in weights.items()}
    counts = {d: int(x) for d, x in exact.items()}
    left = num_samples - sum(counts.values())
    for d in sorted(exact, key=lambda d: -(exact[d] - counts[d]))[:left]:
        counts[d] += 1
    return counts


def spaced_windows(ids: Sequence[int], n: int, seq_len: int) -> List[List[int]]:
    """n windows of seq_len tokens at evenly spaced starts over ids (overlapping when n windows do
    not fit side by side; shorter, as the whole stream, when ids is shorter than seq_len)."""
    if n <= 0:
        return []
    span = max(0, len(ids) - seq_len)
    starts = [0] if n == 1 else [round(i * span / (n - 1)) for i in range(n)]
    return [list(ids[s:s + seq_len]) for s in starts]


def dialogue_windows(convs: List[List[int]], n: int, seq_len: int) -> List[List[int]]:
    """n windows of seq_len tokens, each starting at the start of a conversation (evenly spaced
    over the conversations) and running on into the following ones, so every window opens with
    the chat format's first marker."""
    if n <= 0:
        return []
    out = []
    for i in range(n):
        c = i * len(convs) // n
        w: List[int] = []
        while len(w) < seq_len:
            w.extend(convs[c % len(convs)])
            c += 1
        out.append(w[:seq_len])
    return out


def draw_domains(tokenizer, counts: Dict[str, int], seq_len: int, chat_template=None) -> Dict[str, List[List[int]]]:
    """counts[d] windows of seq_len tokens from each calibration domain d: evenly spaced over the
    prose / code token streams; starting at conversation starts for dialogue."""
    out: Dict[str, List[List[int]]] = {}
    for d, n in counts.items():
        if d == "dialogue":
            convs = [tokenizer.encode(render_dialogue(m, chat_template), add_special_tokens=False).ids
                     for m in dialogues()]
            out[d] = dialogue_windows(convs, n, seq_len)
        else:
            ids = tokenizer.encode(read_data(CALIBRATION_FILES[d]), add_special_tokens=False).ids
            out[d] = spaced_windows(ids, n, seq_len)
    return out


def mix_samples(tokenizer, num_samples: int, seq_len: int, chat_template=None,
                weights: Optional[Dict[str, float]] = None) -> Tuple[List[List[int]], dict]:
    """The default calibration samples: allocate(num_samples, weights) windows of seq_len tokens
    per calibration domain (draw_domains), interleaved domain by domain. Returns (samples,
    provenance) with the provenance recording the mix, each file's sha256, the chat format and
    the samples' hash."""
    weights = dict(weights or CALIBRATION_WEIGHTS)
    counts = allocate(num_samples, weights)
    per_domain = draw_domains(tokenizer, counts, seq_len, chat_template)
    samples: List[List[int]] = []
    for k in range(max(counts.values())):
        samples.extend(per_domain[d][k] for d in weights if k < len(per_domain[d]))
    digest = hashlib.sha256(json.dumps(samples).encode()).hexdigest()
    info = {"source": "tritium-mix:" + ",".join(f"{d}={weights[d]:g}" for d in weights),
            "mix": {d: {"weight": weights[d], "samples": counts[d], "file": CALIBRATION_FILES[d],
                        "sha256": file_sha256(CALIBRATION_FILES[d])} for d in weights},
            "chat_format": "chat template" if chat_template is not None else "plain (User:/Assistant:)",
            "samples_sha256": digest}
    return samples, info


def source_chat_template(source: Optional[str]):
    """The chat template of a build source (an HF folder's tokenizer_config.json or
    chat_template.jinja, or a GGUF's tokenizer.chat_template) as a ChatTemplate, or None."""
    if not source:
        return None
    if os.path.isdir(source):
        src = read_template_source(source)
        return ChatTemplate.from_engine_dir(source) if src is not None else None
    if os.path.isfile(source) and source.lower().endswith(".gguf"):
        import gguf
        fields = gguf.GGUFReader(source).fields
        tpl = fields.get("tokenizer.chat_template")
        if tpl is None:
            return None
        special = {}
        tokens = fields.get("tokenizer.ggml.tokens")
        for key, name in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")):
            if tokens is not None and fields.get(name) is not None:
                special[key] = tokens.contents(int(fields[name].contents()))
        return ChatTemplate(tpl.contents(), special, name=source)
    return None
