"""The shipped calibration mix and held-out texts (builder/data/): provenance hashes, the mix's
proportions and determinism, dialogue in the chat format, no held-out text in calibration, the
build report's held-out domains, and `tritium eval --domain`."""
from __future__ import annotations

import hashlib
import json
import os
import re

import pytest

from tritium.builder import calibration_mix as cm
from tests.tiny_models import train_tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(1000)


def test_shipped_files_match_provenance():
    with open(cm.PROVENANCE_FILE) as f:
        prov = json.load(f)
    listed = set(prov["files"])
    shipped = {f"{sub}/{n}" for sub in ("calibration", "eval") for n in os.listdir(cm.data_path(sub))}
    assert shipped == listed  # every shipped text has its provenance, and nothing listed is missing
    for rel, entry in prov["files"].items():
        with open(cm.data_path(rel), "rb") as f:
            data = f.read()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], rel
        assert len(data) == entry["bytes"]
        for key in ("package", "version", "extraction", "from", "domain", "role"):
            assert entry[key], (rel, key)
        assert entry["license"]["name"] in ("PSF-2.0", "public domain")
        assert entry["license"]["text"] in prov["license_files"]
    for rel, digest in prov["license_files"].items():
        with open(cm.data_path(rel), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest
    # the module's view of the domains agrees with the provenance file
    assert {prov["files"][f]["domain"] for f in cm.CALIBRATION_FILES.values()} == set(cm.CALIBRATION_FILES)
    assert {prov["files"][f]["domain"] for f in cm.HELD_OUT_FILES.values()} == set(cm.HELD_OUT_DOMAINS)
    assert all(prov["files"][f]["role"].startswith("held-out") for f in cm.HELD_OUT_FILES.values())
    assert sum(e["bytes"] for e in prov["files"].values()) < 500_000


def test_allocation_follows_weights():
    # 64 x (0.4, 0.3, 0.3) = 25.6, 19.2, 19.2: floors 25/19/19, the one left goes to prose
    assert cm.allocate(64, {"prose": 0.4, "dialogue": 0.3, "code": 0.3}) == {"prose": 26, "dialogue": 19, "code": 19}
    assert cm.allocate(10, {"a": 0.5, "b": 0.5}) == {"a": 5, "b": 5}
    for n in (1, 3, 7, 64, 257):
        counts = cm.allocate(n, cm.CALIBRATION_WEIGHTS)
        assert sum(counts.values()) == n
        for d, w in cm.CALIBRATION_WEIGHTS.items():
            assert abs(counts[d] - n * w) < 1


def _contains(stream, window):
    s = ",".join(map(str, stream)) + ","
    return ",".join(map(str, window)) + "," in s


def test_mix_draws_every_domain_in_proportion_deterministically(tok):
    samples, info = cm.mix_samples(tok, 20, 64)
    assert len(samples) == 20 and all(len(s) == 64 for s in samples)
    assert {d: e["samples"] for d, e in info["mix"].items()} == {"prose": 8, "dialogue": 6, "code": 6}
    # every sample is a window of exactly one domain's token stream, in the stated numbers
    streams = {d: tok.encode(cm.read_data(f), add_special_tokens=False).ids
               for d, f in cm.CALIBRATION_FILES.items() if d != "dialogue"}
    streams["dialogue"] = [t for m in cm.dialogues()
                           for t in tok.encode(cm.render_dialogue(m), add_special_tokens=False).ids]
    found = {d: 0 for d in streams}
    for s in samples:
        owners = [d for d, ids in streams.items() if _contains(ids, s)]
        assert len(owners) == 1
        found[owners[0]] += 1
    assert found == {"prose": 8, "dialogue": 6, "code": 6}
    # the same inputs give the same samples and hashes; another size gives others
    again, info2 = cm.mix_samples(tok, 20, 64)
    assert again == samples and info2 == info
    assert info["mix"]["prose"]["sha256"] == hashlib.sha256(
        open(cm.data_path(cm.CALIBRATION_FILES["prose"]), "rb").read()).hexdigest()
    assert cm.mix_samples(tok, 21, 64)[1]["samples_sha256"] != info["samples_sha256"]


def test_dialogue_samples_carry_chat_template_markers(tok, tiny_checkpoint, tmp_path):
    import shutil
    src = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), src)
    cfg_path = src / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    template = cm.source_chat_template(str(src))
    assert template is not None
    start, end = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    windows = cm.draw_domains(tok, {"dialogue": 12}, 128, template)["dialogue"]
    assert len(windows) == 12
    for w in windows:
        assert w[0] == start  # every window opens a conversation in the template's format
        assert end in w
    samples, info = cm.mix_samples(tok, 10, 128, template)
    assert info["chat_format"] == "chat template"
    assert sum(1 for s in samples if s[0] == start) >= 3  # the 3 dialogue windows
    # without a template: plain role lines, no special markers
    assert cm.source_chat_template(tiny_checkpoint("llama")) is None
    plain = cm.draw_domains(tok, {"dialogue": 4}, 128, None)["dialogue"]
    for w in plain:
        assert start not in w and tok.decode(w).startswith("User: ")


def _word_ngrams(text: str, n: int = 8):
    words = re.findall(r"[a-z']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_no_held_out_text_in_calibration():
    cal = set()
    for d in cm.CALIBRATION_FILES:
        cal |= _word_ngrams(cm.domain_text(d))
    for d in cm.HELD_OUT_DOMAINS:
        held = _word_ngrams(cm.domain_text(d))
        assert len(held) > 5000
        assert not (held & cal), (d, sorted(held & cal)[:3])
    # the check catches a leak: one held-out sentence inside a calibration text
    leak = cm.domain_text("prose") + cm.domain_text("kjv")[5000:5400]
    assert _word_ngrams(leak) & _word_ngrams(cm.domain_text("kjv"))
    assert not set(cm.HELD_OUT_DOMAINS) & set(cm.CALIBRATION_FILES)


def test_build_report_scores_held_out_domains(tiny_engine):
    qdir = tiny_engine("llama", quantization="int8", kv_cache_dtype="int8", calibration_samples=8, eval_tokens=200)
    with open(os.path.join(qdir, "build_report.json")) as f:
        ev = json.load(f)["quantization_report"]["eval"]
    assert len(ev["held_out_domains"]) >= 2 and set(ev["domains"]) == set(ev["held_out_domains"])
    for d in ev["held_out_domains"]:
        r = ev["domains"][d]
        assert r["tokens"] == 199 and r["perplexity"] > 1 and r["reference_perplexity"] > 1
        assert r["perplexity_increase"] == pytest.approx(r["perplexity"] / r["reference_perplexity"] - 1)
        assert 0 <= r["mean_kl"] and 0 <= r["top1_agreement"] <= 1
    with open(os.path.join(qdir, "engine.json")) as f:
        calib = json.load(f)["quantization"]["calibration"]
    assert set(calib["mix"]) == set(cm.CALIBRATION_FILES)  # the default mix, recorded
    assert not set(calib["mix"]) & set(ev["held_out_domains"])
    assert calib["samples"] == 8 and calib["source"].startswith("tritium-mix:")


def test_eval_domain(tiny_engine, capsys, tmp_path):
    from tritium.client.cli.main import main
    fdir = tiny_engine("llama")
    assert main(["eval", "--engine", fdir, "--domain", "devil", "--num-tokens", "120", "--json"]) == 0
    by_domain = json.loads(capsys.readouterr().out)
    assert by_domain["text"] == "domain:devil" and by_domain["tokens"] == 119
    # the same figures as scoring the shipped file with --text
    path = cm.data_path(cm.HELD_OUT_FILES["devil"])
    assert main(["eval", "--engine", fdir, "--text", path, "--num-tokens", "120", "--json"]) == 0
    by_file = json.loads(capsys.readouterr().out)
    assert by_file["perplexity"] == pytest.approx(by_domain["perplexity"], rel=1e-6)
    # default: the held-out kjv prose
    assert main(["eval", "--engine", fdir, "--num-tokens", "50", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "domain:kjv"
    rc = main(["eval", "--engine", fdir, "--domain", "poetry", "--num-tokens", "50"])
    err = capsys.readouterr().err
    assert rc != 0 and "--domain 'poetry'" in err
    assert all(d in err for d in ("kjv", "devil", "prose", "dialogue", "code"))
    rc = main(["eval", "--engine", fdir, "--domain", "kjv", "--text", path])
    assert rc != 0 and "alternatives" in capsys.readouterr().err
