"""The conformance kit (`tapelm.testing`) run over every registered encoding: the laws tapelm's own encodings are
held to, as anyone's are. And each law can fail: an encoding broken in the way the law forbids fails it, with a
message naming what differs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from conftest import DEVICE, WEIGHT_STD
from tapelm.cli import main
from tapelm.positional.absolute import SinusoidalAbsolute
from tapelm.positional.rotary import RoPE
from tapelm.testing import LAWS, LawFailure, Subject, check_encoding, law_compiles, registered_for_test

pytestmark = pytest.mark.device
COMPILE_BACKEND = "inductor" if DEVICE.type == "cuda" else "eager"  # no C++ build in CI: the capture alone


def subject(pe_type: str) -> Subject:
    return Subject(pe_type, DEVICE, WEIGHT_STD)


@pytest.mark.parametrize("law", [law for law in LAWS if law != "compiles"])
def test_every_encoding_obeys_every_law(pe_type, law):
    LAWS[law](subject(pe_type))


@pytest.mark.compiles
def test_every_encoding_compiles_as_one_graph(pe_type):
    law_compiles(subject(pe_type), backend=COMPILE_BACKEND)


class CountingFromZero(RoPE):
    """Broken: every forward pass numbers its tokens 0, 1, ... whatever positions it is given (a cache's included)."""

    def positions(self, position_ids, past=0, documents=None, extent=None):
        return torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)


class AbsoluteCountingFromZero(SinusoidalAbsolute):
    """Broken: an absolute encoding that numbers its tokens 0, 1, ... whatever positions it is given."""

    positions = CountingFromZero.positions


class AbsoluteIgnoringPositions(SinusoidalAbsolute):
    """Broken: an absolute encoding that numbers its tokens from the cache's length, whatever positions it is given."""

    def positions(self, position_ids, past=0, documents=None, extent=None):
        return past + torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)


class Peeking(RoPE):
    """Broken: every token's input embedding sees the sequence's later tokens."""

    def embed(self, hidden, ctx):
        return hidden + 0.5 * hidden.flip(1)


class ClaimsRelative(SinusoidalAbsolute):
    """Broken: declares itself relative, but adds absolute positions to the embeddings."""

    relative = True


class Unused(RoPE):
    """Broken: a parameter the model never uses, so it gets no gradient."""

    def __init__(self, config):
        super().__init__(config)
        self.unused = nn.Parameter(torch.zeros(2))


class Unsaved(RoPE):
    """Broken: a random tensor it uses, kept out of the saved weights."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("noise", torch.randn(config.hidden_size), persistent=False)

    def embed(self, hidden, ctx):
        return hidden + self.noise.to(hidden.dtype)


class Branching(RoPE):
    """Broken: branches on a value it reads from a tensor, which torch.compile cannot capture in one graph."""

    def embed(self, hidden, ctx):
        return hidden * 2 if hidden.sum().item() > 0 else hidden


class DoubledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.5

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


class WrongBackward(RoPE):
    """Broken: a hand-written backward that doubles the gradient it should give."""

    def embed(self, hidden, ctx):
        return DoubledGradient.apply(hidden)


class ReadsTheLimit(RoPE):
    """Broken: declares that it does not read the position limit, but scales its embeddings by it."""

    reads_position_limit = False

    def __init__(self, config):
        super().__init__(config)
        self.limit = config.max_position_embeddings

    def embed(self, hidden, ctx):
        return hidden * (1 + 1 / self.limit)


class SizedByTheLimit(RoPE):
    """Broken: declares that it does not read the position limit, but sizes a weight it never uses by it."""

    reads_position_limit = False

    def __init__(self, config):
        super().__init__(config)
        self.table = nn.Parameter(torch.zeros(config.max_position_embeddings))


BROKEN = [
    ("causal", Peeking, "outputs before token"),
    ("cache_step", CountingFromZero, "one token at a time and the full pass differ"),
    ("static_cache", CountingFromZero, "a static cache fed in chunks and the full pass differ"),
    ("generation", CountingFromZero, "a dynamic cache and no cache generate different tokens"),
    ("left_padding", AbsoluteCountingFromZero, "the left-padded row and alone differ"),
    ("packed_documents", AbsoluteCountingFromZero, "the packed row's logits and its documents' alone differ"),
    ("positions", AbsoluteCountingFromZero, "chunked decoding from position 37 and the full pass there differ"),
    ("positions", AbsoluteIgnoringPositions, "it ignores the positions it is given"),
    ("relative", ClaimsRelative, "outputs at positions shifted by 1 and unshifted differ"),
    ("bf16_autocast", Unused, "unused gets no gradient"),
    ("save_load", Unsaved, "the loaded model's logits and the saved one's differ"),
    ("compiles", Branching, "torch.compile cannot capture it"),
    ("gradcheck", WrongBackward, "analytical and numerical gradients differ"),
    ("position_limit", ReadsTheLimit, "logits at two position limits differ"),
    ("position_limit", SizedByTheLimit, "names or shapes depend on max_position_embeddings"),
]


def test_every_law_has_an_encoding_that_breaks_it():
    assert {law for law, _, _ in BROKEN} == set(LAWS)


@pytest.mark.parametrize(("law", "broken", "message"), BROKEN, ids=[f"{law}-{cls.__name__}" for law, cls, _ in BROKEN])
def test_a_broken_encoding_fails_its_law_saying_what_differs(law, broken, message):
    with registered_for_test("broken", broken) as made:
        run = LAWS[law] if law != "compiles" else lambda s: law_compiles(s, backend=COMPILE_BACKEND)
        with pytest.raises(LawFailure, match=message):
            run(dataclasses.replace(made, device=DEVICE, std=WEIGHT_STD))


def test_check_encoding_reports_each_law_and_the_command_exits_1_on_a_failure(capsys):
    verdicts = check_encoding("rope", ["causal", "relative"])
    assert [(v.law, v.held) for v in verdicts] == [("causal", True), ("relative", True)]
    assert main(["check-encoding", "rope", "--law", "causal", "cache_step"]) == 0
    shown = capsys.readouterr().out
    assert "held  causal" in shown and "held  cache_step" in shown
    with registered_for_test("broken", Peeking):
        assert main(["check-encoding", "broken", "--law", "causal", "save_load"]) == 1
    shown = capsys.readouterr().out
    assert "FAILED  causal: outputs before token" in shown and "held  save_load" in shown


def test_an_unknown_encoding_or_law_is_refused_before_any_law_runs(capsys):
    with pytest.raises(ValueError, match="pe_type='nothing' is not allowed; choose one of: tape, rope"):
        check_encoding("nothing")
    with pytest.raises(ValueError, match="law 'speed' is not allowed; choose from: causal, cache_step"):
        check_encoding("rope", ["causal", "speed"])
    assert main(["check-encoding", "rope", "--law", "speed"]) == 2
    assert "law 'speed' is not allowed" in capsys.readouterr().err
