"""Streamed text: the deltas of a channel's TokenAccumulator (plus finish) join to exactly the
tokenizer's decode, for any token sequence cut anywhere; the RNNT transcript's deltas to its text.

Every expected value here is ``tokenizer.decode`` (or ``decode_pieces``) of the tokens, never our own
output. Random sequences weight byte tokens up: UTF-8 lead and continuation bytes, invalid bytes,
whole characters split byte by byte, mixed with words, spaces, punctuation and specials.
"""

from __future__ import annotations

import copy
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from nvchat_torch.events import TokenAccumulator
from nvchat_torch.models.rnnt import TranscriptText, decode_pieces
from nvchat_torch.tiny import _hf_tokenizer

SESSION_SKIP = {1, 2, 11, 12}  # the tiny config's BOS, EOS, silence and PAD (session.py's skip set)
CHARS = "a€é😀\u4e2d\ufffd\u00a0 .'"  # 1-4 byte characters (U+FFFD too: a real one must survive)


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


# --------------------------------------------------------------------------------------
# Tokenizers: the tiny model's ByteLevel BPE, and SentencePiece-style byte-fallback ones


@pytest.fixture(scope="module")
def bytelevel():
    tok = _hf_tokenizer()
    vocab = tok.get_vocab()
    char = bytes_to_unicode()
    return tok, {b: vocab[char[b]] for b in range(256)}


SP_WORDS = ["\u2581", "\u2581\u2581", "\u2581a", "\u2581the", "a", "b", "n", "t", "s", "m", "'", ".", ",", "?",
            "\u2581.", "\u2581'", "\u2581n", "'t", "n't", "\u2581n't", "'s", "\u2581's", "'m", "\u2581!", "re", "ve",
            "\u00e9", "\u2581\u00e9", "\u20ac", "\U0001F600", "\ufffd"]


def sentencepiece(kind: str = "bpe", decoder: str = "llama", cleanup: bool = False) -> tuple:
    """A Llama-style tokenizer built in code: ``<unk> <s> </s>``, the 256 byte tokens ``<0x00>``..``<0xFF>``
    (ids 3..258), pieces; byte_fallback on; decoder Replace(▁, " "), ByteFallback, Fuse, Strip(" ", 1, 0)
    ("llama") or ByteFallback, Metaspace ("metaspace"); one extra special token."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_WORDS
    if kind == "bpe":
        model = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                           byte_fallback=True)
    else:
        model = models.Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    if decoder == "llama":
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<SP_X>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 clean_up_tokenization_spaces=cleanup)
    return hf, {b: 3 + b for b in range(256)}


# --------------------------------------------------------------------------------------
# Random id sequences


def random_ids(rng: random.Random, tokenizer, byte_id: dict[int, int], length: int, words: list[int]) -> list[int]:
    vocab = len(tokenizer)
    ids: list[int] = []
    while len(ids) < length:
        r = rng.random()
        if r < 0.25:  # a whole character, split byte by byte (sometimes cut short)
            raw = rng.choice(CHARS).encode()
            if rng.random() < 0.2:
                raw = raw[:rng.randrange(1, len(raw) + 1)]
            ids += [byte_id[b] for b in raw]
        elif r < 0.5:  # a random byte: leads, continuations, invalid bytes
            ids.append(byte_id[rng.choice([rng.randrange(256), rng.randrange(0x80, 0xC0), rng.randrange(0xC0, 0x100),
                                           0xE2, 0xF0, 0x82, 0x80, 0xC0, 0xFF, 0x20, 0x41])])
        elif r < 0.8:
            ids.append(rng.choice(words))
        else:
            ids.append(rng.randrange(vocab))
    return ids[:length]


def stream(tokenizer, skip: set[int], ids: list[int], cut_everywhere: bool = True) -> str:
    """Feed ``ids``, checking at every step against the decode of the kept tokens; returns the joined deltas."""
    acc = TokenAccumulator(tokenizer, skip)
    acc.strict = True
    kept, deltas = [], []
    for token in ids:
        update = acc.append(token)
        if token in skip:
            assert update is None
            continue
        kept.append(token)
        delta, text = update
        deltas.append(delta)
        full = decode(tokenizer, kept)
        assert text == acc.text == "".join(deltas)
        assert full.startswith(text), (kept, text, full)  # emitted text is never revised
        assert acc.full_text == full, (kept, acc.full_text, full)
        if cut_everywhere:  # the stream cut here and finished gives the decode of this prefix
            cut = copy.copy(acc)
            ending = cut.finish()
            assert cut.text == full and (ending is None) == (text == full)
            if ending is not None:
                assert ending == (full[len(text):], full)
    ending = acc.finish()
    if ending is not None:
        deltas.append(ending[0])
        assert ending[1] == acc.text
    joined = "".join(deltas)
    assert joined == acc.text == acc.full_text == decode(tokenizer, kept), (kept, deltas)
    assert acc.finish() is None
    return joined


def deltas_of(tokenizer, ids: list[int]) -> list[str]:
    acc = TokenAccumulator(tokenizer, set())
    acc.strict = True
    out = [acc.append(i)[0] for i in ids]
    ending = acc.finish()
    return out + ([ending[0]] if ending else [])


# --------------------------------------------------------------------------------------
# Property tests


@pytest.mark.parametrize("skip", [SESSION_SKIP, set()], ids=["session-skip", "no-skip"])
def test_bytelevel_deltas_join_to_the_decode(bytelevel, skip):
    tok, byte_id = bytelevel
    vocab = tok.get_vocab()
    words = [vocab[w] for w in ("\u0120hello", "hello", "\u0120the", "\u0120", ".", "a")] + list(range(21))
    rng = random.Random(1234 + len(skip))
    for _ in range(700):
        stream(tok, skip, random_ids(rng, tok, byte_id, rng.randrange(1, 24), words))


@pytest.mark.parametrize("kind,decoder", [("bpe", "llama"), ("unigram", "llama"), ("bpe", "metaspace")])
def test_byte_fallback_deltas_join_to_the_decode(kind, decoder):
    tok, byte_id = sentencepiece(kind, decoder)
    words = [tok.convert_tokens_to_ids(w) for w in SP_WORDS] + [0, 1, 2, tok.convert_tokens_to_ids("<SP_X>")]
    rng = random.Random(99)
    for _ in range(450):
        ids = random_ids(rng, tok, byte_id, rng.randrange(1, 24), words)
        stream(tok, {1} if rng.random() < 0.3 else set(), ids)


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
def test_cleanup_deltas_join_to_the_decode(kind):
    """clean_up_tokenization_spaces=True (transformers 5 applies it to Unigram, not to BPE)."""
    tok, byte_id = sentencepiece(kind, "llama", cleanup=True)
    words = [tok.convert_tokens_to_ids(w) for w in SP_WORDS]
    tricky = [tok.convert_tokens_to_ids(w) for w in ("\u2581", "\u2581'", "'", "\u2581n", "'t", "\u2581.", ".", "s",
                                                     "m", "\u2581's", "re", "ve", "a")]
    rng = random.Random(7)
    for _ in range(450):
        ids = [rng.choice(tricky) if rng.random() < 0.6 else i
               for i in random_ids(rng, tok, byte_id, rng.randrange(1, 20), words)]
        stream(tok, set(), ids)
    if kind == "unigram":  # the clean-up does run, and the stream matches it
        ids = [tok.convert_tokens_to_ids(w) for w in ("\u2581a", "\u2581", "\u2581'", "\u2581", "\u2581.")]
        assert decode(tok, ids) != tok.decode(ids, clean_up_tokenization_spaces=False)
        assert "".join(deltas_of(tok, ids)) == decode(tok, ids)


def test_long_random_streams_keep_a_small_window(bytelevel):
    """Thousands of tokens, garbage bytes included: every decode stays a few tokens long."""
    tok, byte_id = bytelevel
    sizes: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, **kwargs):
            sizes.append(len(ids))
            return tok.decode(ids, **kwargs)

    vocab = tok.get_vocab()
    words = [vocab[w] for w in ("\u0120hello", "\u0120the", "a")]
    rng = random.Random(5)
    ids = random_ids(rng, tok, byte_id, 4000, words)
    acc = TokenAccumulator(Counting(), SESSION_SKIP)
    for i in ids:
        acc.append(i)
    acc.finish()
    kept = [i for i in ids if i not in SESSION_SKIP]
    assert acc.text == decode(tok, kept)
    assert max(sizes) <= 12 and len(sizes) < 6 * len(kept)


# --------------------------------------------------------------------------------------
# Hand-written cases (expected values are the tokenizer's own decodes)


@pytest.fixture(params=["bytelevel", "sentencepiece"])
def any_tokenizer(request, bytelevel):
    """(tokenizer, byte ids, an id that is not a byte token)."""
    if request.param == "bytelevel":
        tok, byte_id = bytelevel
        return tok, byte_id, tok.get_vocab()["\u0120the"]
    tok, byte_id = sentencepiece()
    return tok, byte_id, tok.convert_tokens_to_ids("\u2581the")


def test_a_three_byte_character_over_three_tokens(bytelevel):
    tok, byte_id = bytelevel
    ids = [byte_id[b] for b in "€".encode()]
    assert decode(tok, ids) == "€"
    assert deltas_of(tok, ids) == ["", "", "€"]  # nothing left for finish


def test_a_three_byte_character_in_a_byte_fallback_run():
    """A run of byte tokens settles when a non-byte token ends it (a fourth byte could still make
    the whole run U+FFFD), or at finish."""
    tok, byte_id = sentencepiece()
    ids = [byte_id[b] for b in "€".encode()]
    word = tok.convert_tokens_to_ids("\u2581the")
    assert deltas_of(tok, ids) == ["", "", "", decode(tok, ids)] and decode(tok, ids) == "€"
    assert deltas_of(tok, ids + [word]) == ["", "", "", decode(tok, ids + [word])] == ["", "", "", "€ the"]


def test_a_four_byte_emoji(any_tokenizer):
    tok, byte_id, word = any_tokenizer
    ids = [byte_id[b] for b in "😀".encode()] + [word]
    got = deltas_of(tok, ids)
    assert got[:3] == ["", "", ""] and "".join(got) == decode(tok, ids) and decode(tok, ids).startswith("😀")
    assert "\ufffd" not in "".join(got)


def test_text_around_a_split_character(bytelevel):
    tok, byte_id = bytelevel
    vocab = tok.get_vocab()
    ids = [vocab["hello"]] + [byte_id[b] for b in " €!".encode()]
    got = deltas_of(tok, ids)
    assert got == [decode(tok, ids[:1]), " ", "", "", "€", "!"] and "".join(got) == decode(tok, ids)


def test_an_invalid_byte_then_a_word(any_tokenizer):
    tok, byte_id, word = any_tokenizer
    ids = [byte_id[0x80], word]
    got = deltas_of(tok, ids)
    assert "".join(got) == decode(tok, ids) and decode(tok, ids).startswith("\ufffd")
    assert got[0] == "" and got[1] == decode(tok, ids)


def test_cut_mid_character_then_finished(any_tokenizer):
    tok, byte_id, _ = any_tokenizer
    ids = [byte_id[ord("x")]] + [byte_id[b] for b in "€".encode()[:2]]
    acc = TokenAccumulator(tok, set())
    acc.strict = True
    emitted = "".join(acc.append(i)[0] for i in ids)
    assert "\ufffd" not in emitted  # the incomplete character is held
    delta, text = acc.finish()
    assert emitted + delta == text == decode(tok, ids)  # released as the full decode's U+FFFD(s)
    assert text.endswith("\ufffd")
    with pytest.raises(RuntimeError):
        acc.append(byte_id[0xAC])


def test_a_byte_fallback_run_that_turns_invalid_is_never_shown_valid():
    """<0xE2><0x82><0xAC> is "€", but one more byte makes the whole run four U+FFFD."""
    tok, byte_id = sentencepiece()
    run = [byte_id[b] for b in (0xE2, 0x82, 0xAC)]
    assert decode(tok, run) == "€" and decode(tok, run + [byte_id[0x80]]) == "\ufffd" * 4
    a = tok.convert_tokens_to_ids("\u2581a")
    got = deltas_of(tok, run + [byte_id[0x80], a])
    assert "€" not in "".join(got) and "".join(got) == decode(tok, run + [byte_id[0x80], a])


def test_finish_with_nothing_held(bytelevel):
    tok, _ = bytelevel
    acc = TokenAccumulator(tok, SESSION_SKIP)
    assert acc.finish() is None and acc.text == acc.full_text == ""
    acc = TokenAccumulator(tok, SESSION_SKIP)
    assert acc.append(12) is None
    ids = tok.encode("hello the world", add_special_tokens=False)
    for i in ids:
        acc.append(i)
    assert acc.text == acc.full_text == decode(tok, ids) and acc.finish() is None


# --------------------------------------------------------------------------------------
# The RNNT transcript


def test_transcript_deltas_join_to_its_text():
    vocabulary = ["<unk>", "<en-US>", "<fr-FR>", "<s>", "</s>", "<pad>", "\u2581", "\u2581\u2581", " ", "\t", "\n",
                  "\u3000", "\u00a0", "\x1c", "\u2028", "\u200b", "a", "\u2581b", "c\u2581", "\u2581d\u2581", "<0x0A>",
                  "\u2581word", "'s", "."]
    rng = random.Random(3)
    for _ in range(1500):
        transcript, tokens, deltas = TranscriptText(vocabulary), [], []
        for _ in range(rng.randrange(1, 15)):
            ids = [rng.choice([-1, rng.randrange(-3, len(vocabulary) + 3), rng.randrange(6, 11)])
                   for _ in range(rng.randrange(0, 5))]
            update = transcript.update(ids)
            new = [i for i in ids if i >= 0 and not (i < len(vocabulary) and vocabulary[i] in
                                                      ("<unk>", "<en-US>", "<fr-FR>", "<s>", "</s>", "<pad>"))]
            tokens += new
            full = decode_pieces(tokens, vocabulary).strip()
            if not new:
                assert update is None
            else:
                deltas.append(update[0])
                assert update[1] == transcript.text == full
            assert "".join(deltas) == full == transcript.text
