"""Incremental detokenisation and stop conditions on real (tiny, locally trained) tokenizers."""

from __future__ import annotations

import copy
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.request import SamplingParams
from engine.stop import IncrementalDetokenizer, StopChecker, TextStream

CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "hello there, general kenobi"] * 20


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style): characters outside the corpus split into single-byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    """SentencePiece-style Metaspace BPE: a lone "▁world" decodes to "world", in context to " world"."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def char_ids(tok, text: str) -> list[int]:
    """One token per ASCII character (the byte-level alphabet has them all)."""
    ids = [i for c in text for i in enc(tok, c)]
    assert len(ids) == len(text)
    return ids


def stream(tok, params: SamplingParams, prompt: str = "hello", skip_special_tokens: bool = True) -> TextStream:
    return TextStream.create(tok, enc(tok, prompt), params, [tok.eos_token_id], skip_special_tokens)


def feed_one_by_one(ts: TextStream, ids: list[int]) -> tuple[str, int]:
    consumed = 0
    for t in ids:
        consumed += ts.feed([t]).consumed
    return ts.text, consumed


# ----------------------------------------------------------------------------- detokenizer
def test_multibyte_split_over_tokens_is_held_until_complete(byte_tok):
    text = "hi 😀 你好!"
    ids = enc(byte_tok, text)
    assert len(ids) > len(text)  # the emoji and CJK characters are split into byte tokens
    detok = IncrementalDetokenizer(byte_tok, enc(byte_tok, "hello"))
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    emoji_start = ids.index(enc(byte_tok, "😀")[0])
    assert deltas[emoji_start:emoji_start + 3] == ["", "", ""]
    assert deltas[emoji_start + 3] == "😀"


def test_flush_returns_incomplete_utf8_at_the_end(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [])
    assert detok.add(enc(byte_tok, "a")[0]) == "a"
    assert detok.add(enc(byte_tok, "😀")[0]) == ""
    assert detok.flush() == "\ufffd"


def test_sentencepiece_leading_spaces_need_context(sp_tok):
    prompt, gen = enc(sp_tok, "hello there"), enc(sp_tok, "the quick brown fox")
    detok = IncrementalDetokenizer(sp_tok, prompt)
    got = "".join(detok.add(t) for t in gen)
    full = sp_tok.decode(prompt + gen)
    assert got == full[len(sp_tok.decode(prompt)):] == " the quick brown fox"
    assert "".join(sp_tok.decode([t]) for t in gen) != got  # naive per-token decoding loses the spaces


def test_empty_prompt_matches_plain_decode(sp_tok):
    gen = enc(sp_tok, "hello world")
    detok = IncrementalDetokenizer(sp_tok, [])
    assert "".join(detok.add(t) for t in gen) == sp_tok.decode(gen) == "hello world"


# ----------------------------------------------------------------------------- stop strings
def test_stop_string_spanning_three_tokens_one_by_one(byte_tok):
    ids = char_ids(byte_tok, "ab XYZ cd")
    ts = stream(byte_tok, SamplingParams(stop=["XYZ"], max_tokens=50))
    emitted = [ts.feed([t]).text for t in ids[:5]]
    assert emitted == ["a", "b", " ", "", ""]  # "X", "XY" are withheld: they may start "XYZ"
    upd = ts.feed([ids[5]])
    assert (upd.text, upd.consumed, upd.finished, upd.finish_reason, upd.stop_reason) == ("", 1, True, "stop", "XYZ")
    after = ts.feed(ids[6:])
    assert (after.text, after.consumed) == ("", 0)
    assert ts.text == "ab " and ts.num_tokens == 6


def test_stop_string_spanning_three_tokens_all_at_once(byte_tok):
    ids = char_ids(byte_tok, "ab XYZ cd")
    ts = stream(byte_tok, SamplingParams(stop=["XYZ"], max_tokens=50))
    upd = ts.feed(ids)
    assert (upd.text, upd.consumed, upd.finish_reason, upd.stop_reason) == ("ab ", 6, "stop", "XYZ")


def test_stop_string_at_the_very_start(byte_tok):
    ts = stream(byte_tok, SamplingParams(stop=["hello"], max_tokens=50))
    upd = ts.feed(enc(byte_tok, "hello world"))
    assert (upd.text, upd.consumed, upd.finish_reason) == ("", 1, "stop")  # "hello" is a single token


def test_text_after_stop_inside_the_same_token_is_never_emitted(byte_tok):
    ids = enc(byte_tok, "the hello world")
    assert enc(byte_tok, "hello") == [ids[-2]]
    ts = stream(byte_tok, SamplingParams(stop=["ell"], max_tokens=50))
    upd = ts.feed(ids)
    assert upd.text == "the h" and upd.consumed == len(ids) - 1
    assert "llo" not in ts.text and "world" not in ts.text


@pytest.mark.parametrize("chunked", [False, True])
def test_overlapping_stop_strings_first_completed_wins(byte_tok, chunked):
    ids = char_ids(byte_tok, "xabcde")
    for stops, expect, reason in [
        (["abcd", "bc"], "xa", "bc"),  # "bc" completes before "abcd"
        (["bc", "abc"], "x", "abc"),  # both complete at "c": the earlier start wins
        (["cd", "abcde", "e"], "xab", "cd"),
    ]:
        ts = stream(byte_tok, SamplingParams(stop=stops, max_tokens=50))
        text = ts.feed(ids).text if chunked else feed_one_by_one(ts, ids)[0]
        assert (text, ts.stop_reason) == (expect, reason)


def test_find_stop_and_holdback():
    chk = StopChecker(["abcd", "bc", "zz"])
    assert chk.find_stop("xxabcd") == (3, "bc")
    assert chk.find_stop("nothing") is None
    assert chk.holdback("xxab") == 2 and chk.holdback("xxa") == 1 and chk.holdback("xz") == 1
    assert chk.holdback("xxabx") == 0 and StopChecker([]).holdback("abc") == 0


def test_held_back_text_is_flushed_on_length(byte_tok):
    ids = char_ids(byte_tok, "ab XY")
    ts = stream(byte_tok, SamplingParams(stop=["XYZ"], max_tokens=5))
    upd = ts.feed(ids + char_ids(byte_tok, "Z"))
    assert (upd.text, upd.consumed, upd.finish_reason, upd.stop_reason) == ("ab XY", 5, "length", None)


def test_eos_finishes_flushes_and_emits_no_eos_text(byte_tok):
    eos = byte_tok.eos_token_id
    ids = char_ids(byte_tok, "ab XY") + [eos] + char_ids(byte_tok, "Z")
    ts = stream(byte_tok, SamplingParams(stop=["XYZ"], max_tokens=50), skip_special_tokens=False)
    text, consumed = feed_one_by_one(ts, ids)
    assert (text, consumed, ts.finish_reason, ts.stop_reason) == ("ab XY", 6, "stop", eos)
    assert "<eos>" not in text


def test_ignore_eos_and_stop_token_ids(byte_tok):
    eos = byte_tok.eos_token_id
    ab = char_ids(byte_tok, "ab")
    ts = stream(byte_tok, SamplingParams(ignore_eos=True, max_tokens=4))
    upd = ts.feed([ab[0], eos, ab[1], ab[0], ab[1]])
    assert (upd.text, upd.consumed, upd.finish_reason) == ("ab" + "a", 4, "length")
    ts = stream(byte_tok, SamplingParams(stop_token_ids=[ab[1]], max_tokens=10))
    upd = ts.feed(ab + ab)
    assert (upd.text, upd.consumed, upd.finish_reason, upd.stop_reason) == ("a", 2, "stop", ab[1])


def test_max_tokens_truncates_a_multi_token_step(byte_tok):
    ids = enc(byte_tok, "the quick brown fox jumps")
    ts = stream(byte_tok, SamplingParams(max_tokens=3))
    upd = ts.feed(ids)
    assert upd.consumed == 3 and upd.finish_reason == "length"
    assert upd.text == byte_tok.decode(ids[:3])


def test_stop_string_made_of_split_multibyte_character(byte_tok):
    ids = enc(byte_tok, "hi 😀 there")
    ts = stream(byte_tok, SamplingParams(stop=["😀"], max_tokens=50))
    text, consumed = feed_one_by_one(ts, ids)
    assert (text, consumed, ts.stop_reason) == ("hi ", 3 + 4, "😀")


def test_streaming_equals_reference_for_any_chunking(byte_tok):
    """Random texts, stop strings and step sizes: output is the text cut before the first-completed stop."""
    rng = random.Random(0)
    for _ in range(60):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        expect = text[:min(ends)[1]] if ends else text
        ids = char_ids(byte_tok, text)
        ts = stream(byte_tok, SamplingParams(stop=stops, max_tokens=100))
        pos, pieces = 0, []
        while pos < len(ids) and not ts.finished:
            step = rng.randint(1, 4)
            upd = ts.feed(ids[pos:pos + step])
            assert upd.consumed <= step
            pieces.append(upd.text)
            pos += upd.consumed
        if not ts.finished:  # ran out of tokens: the caller would finish; emulate with EOS
            pieces.append(ts.feed([byte_tok.eos_token_id]).text)
        assert "".join(pieces) == ts.text == expect, (text, stops)


def test_a_stream_without_stop_strings_gives_what_one_with_an_absent_stop_string_gives(byte_tok):
    """Without stop strings nothing is looked for or withheld; its pieces, consumed counts and
    ends are those of a stream whose stop string never occurs, multibyte characters and a
    ``max_tokens`` inside one included."""
    rng = random.Random(1)
    for _ in range(40):
        text = "".join(rng.choice(["a", "b", " ", "é", "😀", "中"]) for _ in range(rng.randint(1, 10)))
        ids = [i for c in text for i in enc(byte_tok, c)]  # a multibyte character: several tokens
        limit = rng.randint(1, len(ids) + 2)
        plain = stream(byte_tok, SamplingParams(max_tokens=limit))
        absent = stream(byte_tok, SamplingParams(stop=["QQ"], max_tokens=limit))
        pos = 0
        while pos < len(ids) and not plain.finished:
            step = rng.randint(1, 4)
            a, b = plain.feed(ids[pos:pos + step]), absent.feed(ids[pos:pos + step])
            assert a == b, (text, limit)
            pos += a.consumed
        assert (plain.text, plain.finished, plain.num_tokens) == (absent.text, absent.finished, absent.num_tokens)


def test_invalid_checker_config():
    with pytest.raises(ValueError):
        StopChecker([""])
    with pytest.raises(ValueError):
        StopChecker(max_tokens=0)


def test_holdback_equals_the_longest_suffix_that_is_a_proper_prefix():
    """The linear-memory KMP holdback against the definition, on random small alphabets (where
    overlaps are frequent), and on a long stop string that used to cost memory quadratic in it."""
    import random

    def by_definition(stops, text):
        prefixes = {s[:i] for s in stops for i in range(1, len(s))}
        for n in range(min(len(text), max(len(s) for s in stops)), 0, -1):
            if text[-n:] in prefixes:
                return n
        return 0

    rng = random.Random(0)
    for _ in range(5000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 10)))
        checker = StopChecker(stops)
        assert checker.holdback(text) == by_definition(checker.stop_strings, text), (stops, text)
    long = "ab" * 32_000  # 64k characters
    checker = StopChecker([long])
    assert checker.holdback("zz" + long[:1000]) == 1000 and checker.holdback("zzz") == 0


@pytest.mark.parametrize("name", ["byte_tok", "sp_tok"])
def test_the_detokenizer_reads_the_backend_and_gives_the_wrappers_text(name, request) -> None:
    """A library fast tokenizer is decoded through its ``tokenizers`` backend (the wrapper's work
    skipped): the same deltas, token by token, as a tokenizer that must go through ``decode``."""
    fast = request.getfixturevalue(name)

    class OwnDecode(type(fast)):  # a class that decodes its own way keeps its decode
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs)

    slow = copy.copy(fast)
    slow.__class__ = OwnDecode
    assert IncrementalDetokenizer(fast, [])._backend is not None
    assert IncrementalDetokenizer(slow, [])._backend is None

    class Forwarding:  # forwards every attribute, the backend's included, but is no library tokenizer
        def __getattr__(self, attr):
            return getattr(fast, attr)
    assert IncrementalDetokenizer(Forwarding(), [])._backend is None
    rng = random.Random(7)
    for _ in range(20):
        prompt = [rng.randrange(len(fast)) for _ in range(rng.randrange(0, 6))]
        ids = [rng.randrange(len(fast)) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            a, b = IncrementalDetokenizer(fast, prompt, skip), IncrementalDetokenizer(slow, prompt, skip)
            assert [a.add(t) for t in ids] == [b.add(t) for t in ids]
            assert a.flush() == b.flush() and a.text == b.text
