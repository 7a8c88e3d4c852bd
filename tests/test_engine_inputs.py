"""The Python Engine's inputs: each bad one a TandemError naming it, arrays of token ids taken as lists, a stop
string kept whole, and a stream whose KV cache a later call took stops with an error instead of going on corrupted.

References: a fresh engine's output for the same requests, and the token ids as a plain list."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers_tiny import build_tiny_chat_model
from online import Engine
from tandem.core.errors import TandemError


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("engine-inputs") / "model")


@pytest.fixture(scope="module")
def engine(tiny_folder):
    return Engine.load(str(tiny_folder))


def test_a_stream_whose_cache_went_to_a_later_call_stops_with_an_error(tiny_folder):
    """One engine, one KV cache: a second stream, or logits, taken while a stream is open used to corrupt it
    silently. Resuming it now raises; a stream left behind does not disturb the next call (reference: the same
    requests on a fresh engine)."""
    from online import Engine
    from tandem.core.errors import TandemError
    ref = Engine.load(str(tiny_folder))
    want = ref.generate("Once upon a time", max_new_tokens=12, ignore_eos=True).text
    engine = Engine.load(str(tiny_folder))
    for interloper in (lambda: next(iter(engine.stream("The quick brown fox", max_new_tokens=12, ignore_eos=True))),
                       lambda: engine.logits([1, 2, 3])):
        first = iter(engine.stream("Once upon a time", max_new_tokens=12, ignore_eos=True))
        shown = next(first)
        interloper()
        with pytest.raises(TandemError, match="KV cache went to a later call"):
            shown += "".join(first)
        assert want.startswith(shown)
    abandoned = iter(engine.stream("The quick brown fox", max_new_tokens=12, ignore_eos=True))
    next(abandoned)
    assert engine.generate("Once upon a time", max_new_tokens=12, ignore_eos=True).text == want



def test_bad_inputs_name_themselves_and_arrays_are_token_lists(engine):
    ids = [1, 5, 9, 14]
    want = engine.logits(ids)
    for same in (np.array(ids), torch.tensor(ids), tuple(ids), [np.int64(i) for i in ids]):
        assert torch.equal(engine.logits(same), want)
    text = engine.generate("Once upon a time", max_new_tokens=8, ignore_eos=True).text
    one = engine.generate("Once upon a time", max_new_tokens=8, ignore_eos=True, stop=text[2:5])
    assert one.text == text[:text.index(text[2:5])]  # the string as one stop string, not its characters
    assert torch.equal(engine.step_logits(np.array(ids)), engine.step_logits(ids))
    calls = [lambda: engine.logits("hello"), lambda: engine.logits([True, 2]), lambda: engine.logits(None),
             lambda: engine.step_logits(["a"]), lambda: engine.step_logits([True, 2]),
             lambda: engine.perplexity(ids * 4, window_tokens=0), lambda: engine.perplexity(ids * 4, window_tokens=2.5),
             lambda: engine.perplexity(ids * 4, window_tokens=8, stride_tokens=None),
             lambda: engine.perplexity(ids * 4, window_tokens=8, stride_tokens=9),
             lambda: engine.perplexity(None), lambda: engine.generate("hi", stop=5),
             lambda: engine.generate("hi", stop=""), lambda: engine.generate("hi", ignore_eos="no"),
             lambda: engine.generate("hi", logprobs=None), lambda: engine.generate("hi", temperature=True),
             lambda: engine.generate("hi", top_p=True), lambda: Engine.from_args("smollm2")]
    for call in calls:
        with pytest.raises(TandemError):
            call()


def test_a_context_longer_than_the_models_is_refused_not_clamped(tiny_folder, engine):
    """A context length past the model's used to be cut to the model's in silence (vLLM refuses it); the model's
    own length and shorter ones load, and a shorter one bounds the prompt."""
    longest = engine.config.max_context
    with pytest.raises(TandemError, match=f"longer than .*context length \\({longest} tokens\\)"):
        Engine.load(str(tiny_folder), context_length=longest + 1)
    assert Engine.load(str(tiny_folder), context_length=longest).max_context == longest
    short = Engine.load(str(tiny_folder), context_length=8)
    assert short.max_context == 8
    with pytest.raises(TandemError, match="the context holds 8"):
        short.generate([1] * 8, max_new_tokens=1)
    assert len(short.generate([1] * 6, max_new_tokens=2, ignore_eos=True).token_ids) == 2


def test_switches_the_dense_runtime_has_nothing_to_switch_off_are_refused(tiny_folder):
    """sparse=False and prefetch=False were accepted on the dense float32 runtime (no expert cache, every neuron
    computed) and changed nothing; with what they act on they load (reference: the plain int4 engine's tokens)."""
    for kwargs, fragment in (({"sparse": False}, "--no-sparse"), ({"prefetch": False}, "--no-prefetch")):
        with pytest.raises(TandemError, match=fragment):
            Engine.load(str(tiny_folder), **kwargs)
    want = Engine.load(str(tiny_folder), weight_format="int4").generate("Once", max_new_tokens=6, ignore_eos=True)
    got = Engine.load(str(tiny_folder), weight_format="int4", sparse=False).generate("Once", max_new_tokens=6,
                                                                                     ignore_eos=True)
    assert got.token_ids == want.token_ids  # (a model without thresholds: no neuron was skipped either way)
