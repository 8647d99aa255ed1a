"""Token-at-a-time detokenization of byte-level BPE tokenizers (backend/byte_pieces.py): after
every token, the detokenizer's text equals tokenizers' own decode of all ids so far, byte for byte,
with and without special tokens, over adversarial id sequences (characters split across tokens,
invalid UTF-8, special and added tokens, ids outside the vocabulary). The oracle is the Rust
`tokenizers` decode; decoders that look at neighbouring tokens keep the whole decode."""
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tritium.backend.byte_pieces import byte_alphabet, token_pieces
from tritium.backend.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


def _byte_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<|im_start|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world the quick brown fox", "café 東京 🙂 naïve"] * 5, trainer)
    # an added token that is not special, one with characters outside the byte alphabet, a special one
    tok.add_tokens(["<tool>", AddedToken("é中 x", normalized=False)])
    tok.add_special_tokens(["<|special_extra|>"])
    return tok


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_gguf):
    from tritium.builder.quant.quant_pipeline import load_source_tokenizer
    return load_source_tokenizer(smollm2_gguf)


def _sequences(tok, rng, n, length):
    """Random ids weighted towards the troublesome ones: single-byte tokens (partial characters,
    invalid UTF-8), special and added tokens, ids past the vocabulary."""
    size = tok.get_vocab_size(with_added_tokens=True)
    alphabet = byte_alphabet()
    vocab = tok.get_vocab(with_added_tokens=True)
    byte_ids = [vocab[c] for c in alphabet if c in vocab]
    high_bytes = [vocab[c] for c, b in alphabet.items() if c in vocab and b >= 0x80]
    added = sorted(tok.get_added_tokens_decoder())
    pools = [range(size), byte_ids, high_bytes, added, [size, size + 7]]
    for _ in range(n):
        yield [rng.choice(rng.choices(pools, weights=[5, 2, 4, 1, 0.2])[0]) for _ in range(length)]


def _check_stream(tok, ids, skip, step):
    d = IncrementalDetokenizer(tok, (), skip_special_tokens=skip)
    assert d._pieces is not None, "a byte-level tokenizer must take the token-at-a-time path"
    deltas = []
    for i in range(0, len(ids), step):
        d.add_tokens(ids[i:i + step])
        want = tok.decode(ids[:i + step], skip_special_tokens=skip)
        assert d.text.encode() == want.encode(), (ids[:i + step], d.text, want)
        deltas.append(d.delta(finished=i + step >= len(ids)))
    assert "".join(deltas).encode() == tok.decode(ids, skip_special_tokens=skip).encode()


@pytest.mark.parametrize("which", ["byte_bpe", "smollm2"])
@pytest.mark.parametrize("skip", [True, False])
def test_text_equals_whole_decode_after_every_token(request, which, skip):
    tok = _byte_bpe() if which == "byte_bpe" else request.getfixturevalue("smollm2_tok")
    rng = random.Random(29 + skip)
    seqs = list(_sequences(tok, rng, 60, 40))
    # real text split into single-byte tokens: every multi-byte character arrives in pieces
    vocab = tok.get_vocab(with_added_tokens=True)
    inv = {b: c for c, b in byte_alphabet().items()}
    seqs.append([vocab[inv[b]] for b in "naïve 東京 🙂 𝄞!".encode()])
    saw_partial = False
    for ids in seqs:
        for step in (1, 3):
            _check_stream(tok, ids, skip, step)
        saw_partial |= any(tok.decode(ids[:k], skip_special_tokens=skip).endswith(REPLACEMENT_CHAR)
                           for k in range(1, len(ids)))
    assert saw_partial  # the sequences really cut characters in half


def test_stop_string_on_the_incremental_path(smollm2_tok):
    tok = smollm2_tok
    ids = tok.encode("The river runs past the old mill and on to the sea").ids
    d = IncrementalDetokenizer(tok, ["old mill"])
    out, stopped = [], None
    for i in ids:
        stopped = d.add_tokens([i])
        out.append(d.delta(finished=stopped is not None))
        if stopped:
            break
    assert stopped == "old mill"
    assert "".join(out) == "The river runs past the "


def test_context_dependent_decoders_keep_the_whole_decode():
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "▁a": 3}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    assert token_pieces(tok) is None
    d = IncrementalDetokenizer(tok, ())
    for k, i in enumerate([3, 2, 3], 1):
        d.add_tokens([i])
        assert d.text == tok.decode([3, 2, 3][:k])


def test_byte_alphabet_is_a_bijection_onto_bytes():
    table = byte_alphabet()
    assert sorted(table.values()) == list(range(256))
    assert table["!"] == 33 and table["Ġ"] == 32  # GPT-2's space
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())  # tokenizers' own 256 characters


def test_whole_decode_flag_takes_the_whole_decode(smollm2_tok):
    d = IncrementalDetokenizer(smollm2_tok, (), whole_decode=True)
    assert d._pieces is None
    ids = smollm2_tok.encode("naïve 東京").ids
    d.add_tokens(ids)
    assert d.text == smollm2_tok.decode(ids)


def test_detok_bench_runs_and_names_bad_flags(tiny_engine, capsys):
    from tritium.client.bench import detok_bench
    eng = tiny_engine("llama")
    assert detok_bench.main([eng, "--lengths", "12", "--streams", "2", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "whole decode us/token" in out and len(out.strip().splitlines()) == 3
    assert detok_bench.main([eng, "--lengths", "x"]) == 2
    assert "--lengths" in capsys.readouterr().err
