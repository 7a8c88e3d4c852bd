"""TextDecoder (Engine.stream's and the server's text) against the full decode it replaced: every prefix
decoded whole, stop strings searched in all of it, on SmolLM2's tokenizer and a byte-fallback SentencePiece one."""
from __future__ import annotations

import random

import pytest

from tandem.core.loading.detokenize import TextDecoder
from tandem.core.loading.gguf_loader import read_gguf
from tandem.core.loading.tokenizer import Tokenizer

TEXTS = ["The sea is a vast and mysterious realm.\n\nWaves fold over waves, 🚀 and 中文 and Ünïcödé.",
         "def f(x):\n    return x**2  # square\n\nprint(f(3))", "a b c d e f g h i j k l m n o p"]


def reference(tok, ids, stop):
    """The algorithm TextDecoder replaced (engine.py / server/sequence.py until 2026-11-29): the whole
    generated list decoded at every token, the earliest stop string cut, partial characters held back."""
    hold_back, emitted, pieces, text = max((len(s) for s in stop), default=1) - 1, 0, [], ""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        cut = min((text.find(s) for s in stop if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
            pieces.append(text[emitted:] if cut > emitted else "")
            return pieces, text, True, n
        safe = len(text) - hold_back
        while safe > emitted and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe > emitted:
            pieces.append(text[emitted:safe])
            emitted = safe
    pieces.append(text[emitted:])
    return pieces, text, False, len(ids)


def decoded(tok, ids, stop):
    dec, pieces = TextDecoder(tok, stop), []
    for n, i in enumerate(ids, 1):
        piece, stopped = dec.push(i)
        pieces.append(piece)
        if stopped:
            return pieces, dec.text, True, n
    pieces.append(dec.flush())
    return pieces, dec.text, dec.stopped, len(ids)


@pytest.fixture(scope="module")
def smol_tok(smollm2_path) -> Tokenizer:
    _, fields = read_gguf(smollm2_path)
    return Tokenizer.from_gguf_metadata(fields)


@pytest.mark.parametrize("text", TEXTS)
def test_text_stops_and_pieces_equal_the_full_decode(smol_tok, text):
    ids = smol_tok.encode(text, add_special_tokens=False)
    full = smol_tok.decode(ids)
    rng = random.Random(0)
    stops = [(), ("\n\n",), ("zzz-never",), (full[5:9], full[len(full) // 2:len(full) // 2 + 3])]
    stops += [(full[a:a + rng.randint(1, 6)],) for a in rng.sample(range(len(full) - 6), 5)]
    for stop in stops:
        want_pieces, want_text, want_stopped, want_n = reference(smol_tok, ids, stop)
        pieces, got_text, stopped, n = decoded(smol_tok, ids, stop)
        assert (got_text, stopped, n) == (want_text, want_stopped, want_n), stop
        assert "".join(pieces) == "".join(want_pieces) == got_text


def test_random_ids_and_no_tokenizer(smol_tok):
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(smol_tok.vocab_size) for _ in range(40)]
        stop = (smol_tok.decode(ids)[10:12],) if len(smol_tok.decode(ids)) > 12 else ()
        _, want_text, want_stopped, _ = reference(smol_tok, ids, stop)
        pieces, got_text, stopped, _ = decoded(smol_tok, ids, stop)
        assert (got_text, stopped) == (want_text, want_stopped)
        assert "".join(pieces) == got_text
    dec = TextDecoder(None, ("x",))
    assert dec.push(5) == ("", False) and dec.flush() == "" and dec.generated == [5] and dec.text == ""


def test_byte_fallback_pieces_complete_before_they_are_shown(tmp_path):
    from tests.test_tokenizer import write_sentencepiece_gguf

    write_sentencepiece_gguf(tmp_path / "sp.gguf")
    _, fields = read_gguf(tmp_path / "sp.gguf")
    tok = Tokenizer.from_gguf_metadata(fields)
    ids = tok.encode("héllo wörld 🚀 中文 the end", add_special_tokens=False)
    full = tok.decode(ids)
    for stop in [(), ("end",), ("🚀",), ("wörld",)]:
        _, want_text, want_stopped, _ = reference(tok, ids, stop)
        pieces, got_text, stopped, _ = decoded(tok, ids, stop)
        assert (got_text, stopped) == (want_text, want_stopped)
        assert "".join(pieces) == got_text and "\ufffd" not in got_text
    assert decoded(tok, ids, ())[1] == full


def test_only_a_tail_that_may_begin_a_stop_string_waits(smol_tok):
    """After every token the text shown is everything decoded so far but its longest tail that is a proper
    prefix of a stop string (brute force over all tails); a long stop string the text never approaches
    holds nothing back (it held back len(stop) - 1 characters once, so an 80-character stop string delayed
    a whole short answer to its end)."""
    text = TEXTS[2] + " " + TEXTS[0]
    ids = smol_tok.encode(text, add_special_tokens=False)
    for stop in [("z" * 80,), ("i j k l X",), ("e f", "f g h Q", "\n\nW"), ("Waves fold over waves, 🚀 and 中文 and X",)]:
        dec, shown = TextDecoder(smol_tok, stop), ""
        for n, i in enumerate(ids, 1):
            piece, stopped = dec.push(i)
            shown += piece
            if stopped:
                break
            so_far = smol_tok.decode(ids[:n])
            if so_far.endswith("\ufffd"):  # a partial character: its token's text waits in any case
                continue
            held = max((k for s in stop for k in range(1, min(len(s), len(so_far) + 1))
                        if so_far.endswith(s[:k])), default=0)
            assert shown == so_far[:len(so_far) - held], (stop, n)
