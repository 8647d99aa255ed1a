"""Incremental detokenization: deltas join byte for byte to tokenizer.decode of all ids, for
byte-level BPE and for a SentencePiece-style tokenizer with byte fallback; stop strings."""
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tritium.backend.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, stop_prefix_overlap

TEXTS = [
    "Hello world, café naïve jalapeño!",
    "東京 and Zürich: ½ price 🙂🚀 today",
    "  leading spaces and\nnewlines\t tabs 🙂",
    "€€€ 𝄞 mixed ascii",
]


@pytest.fixture(scope="module")
def byte_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Trained on ASCII only, so every non-ASCII character is split into byte tokens.
    tok.train_from_iterator(["hello world the quick brown fox", "leading spaces and newlines"] * 5, trainer)
    return tok


@pytest.fixture(scope="module")
def sentencepiece_like():
    """Llama-2-style: '▁' for spaces, a prepended '▁', byte-fallback <0xNN> tokens, Strip decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁"] + list("abcdefghijklmnopqrstuvwxyzHWZ,!:.\n\t") + ["▁he", "llo", "▁wor", "ld"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("ll", "o"), ("▁", "w"), ("▁w", "o"), ("▁wo", "r"),
              ("l", "d")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def stream(tok, ids, stop=(), step=1):
    d = IncrementalDetokenizer(tok, stop)
    deltas, stopped = [], None
    for i in range(0, len(ids), step):
        stopped = d.add_tokens(ids[i:i + step])
        deltas.append(d.delta(finished=stopped is not None or i + step >= len(ids)))
        if stopped:
            break
    return deltas, stopped, d


@pytest.mark.parametrize("fixture", ["byte_bpe", "sentencepiece_like"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_full_decode(request, fixture, text):
    tok = request.getfixturevalue(fixture)
    ids = tok.encode(text).ids
    full = tok.decode(ids)
    assert REPLACEMENT_CHAR not in full
    for step in (1, 2, 3):
        deltas, _, _ = stream(tok, ids, step=step)
        assert "".join(deltas).encode() == full.encode()
        # No delta ever carries a replacement char for a character that completes later.
        assert all(REPLACEMENT_CHAR not in d for d in deltas)
    # Sanity: the test really splits characters across tokens.
    singles = [tok.decode([i]) for i in ids]
    if any(ord(c) > 127 for c in text):
        assert any(REPLACEMENT_CHAR in s for s in singles)


def test_sentencepiece_leading_space_kept_after_first_token(sentencepiece_like):
    tok = sentencepiece_like
    ids = tok.encode("hello world").ids
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == "hello world"
    assert any(d.startswith(" ") for d in deltas[1:])  # " wor..." keeps its space


def test_invalid_bytes_released_when_followed_by_text(byte_bpe):
    tok = byte_bpe
    lone = tok.encode("é").ids[:1]  # first byte of a 2-byte character, never completed
    ids = lone + tok.encode("hello").ids
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[0] == ""  # held back while it might still complete


def test_stop_string_across_tokens_not_emitted(byte_bpe):
    tok = byte_bpe
    text = "hello world the quick brown fox"
    ids = tok.encode(text).ids
    deltas, stopped, d = stream(tok, ids, stop=["the qu", "zzz"])
    assert stopped == "the qu"
    assert "".join(deltas) == "hello world "
    assert d.text == "hello world "
    # A stop string made of several tokens is caught even though no single token holds it.
    assert all("the qu" not in tok.decode([i]) for i in ids)


def test_partial_stop_prefix_held_then_released(byte_bpe):
    tok = byte_bpe
    ids = tok.encode("hello world").ids
    d = IncrementalDetokenizer(tok, ["worx"])
    out = []
    for i in range(len(ids)):
        assert d.add_tokens(ids[i:i + 1]) is None
        out.append(d.delta(finished=False))
        # While the text ends in "w", "wo" or "wor" that tail may still become "worx": held.
        assert not d.emitted_text.endswith(("w", "wo", "wor"))
        assert d.text.startswith(d.emitted_text)
    out.append(d.delta(finished=True))
    assert "".join(out) == "hello world"


def test_stop_prefix_overlap():
    assert stop_prefix_overlap("abc wo", ["world"]) == 2
    assert stop_prefix_overlap("abc w", ["world", "xw"]) == 1
    assert stop_prefix_overlap("abc", ["world"]) == 0
    assert stop_prefix_overlap("wor", ["wor"]) == 0  # a full match is a stop, not a prefix
