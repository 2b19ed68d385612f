"""The conformance kit: the laws every positional encoding is held to, tapelm's own and anyone's.

Each law is a function of a `Subject` (an encoding's name and how to build its tiny models) that returns the largest
difference it measured and raises `LawFailure`, naming what failed and by how much, when the law does not hold.
`check_encoding(name)` runs them all (`tapelm check-encoding NAME` prints the same), and a user's pytest suite can
call any one:

    from tapelm.testing import Subject, law_cache_step
    def test_my_encoding_decodes_as_it_computes():
        law_cache_step(Subject("my-encoding"))

The models are tiny (two layers of 4 heads of width 8) with random non-zero weights in float64, so that a law that
holds shows differences of rounding only (1e-10 and below); the encoding's own `test_options` keep them small and
deterministic. tapelm's own test suite is this kit run over the registry.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.autograd.gradcheck import GradcheckError
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from .config import TapeConfig
from .modeling import TapeForCausalLM
from .positional import (
    PositionalEncoding,
    encoding_class,
    is_registered,
    layer_encodings,
    register_encoding,
    registered,
    unregister_encoding,
)

TOLERANCE = 1e-10
"""The largest difference a law allows in float64."""
TINY = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
"""The sizes of the kit's models: 2 layers, 4 heads of width 8 sharing 2 key-value heads (grouped-query attention)."""


class LawFailure(AssertionError):
    """A law that does not hold: the message names the law, what differs, and by how much."""


@dataclass(frozen=True)
class Subject:
    """An encoding under test: `pe_type` (a registered name), the device its models are built on, the scale of their
    random weights and config values of its own (`options`, e.g. a `layer_pe_types` schedule)."""

    pe_type: str
    device: torch.device = torch.device("cpu")
    std: float = 0.3
    options: dict = field(default_factory=dict)

    def config(self, **overrides) -> TapeConfig:
        """The tiny config, with every registered encoding's `test_options`, then `options` and `overrides`."""
        return tiny_config(self.pe_type, **{**self.options, **overrides})

    def model(self, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> TapeForCausalLM:
        """A tiny model with random non-zero weights (`randomize`), in eval mode."""
        torch.manual_seed(seed)
        with torch.device(self.device):
            model = TapeForCausalLM(self.config(**overrides))
        return randomize(model, self.std, seed).to(dtype).eval()

    def tokens(self, batch: int, length: int, seed: int = 0) -> torch.Tensor:
        """Random token ids (drawn on the CPU: the same on every device)."""
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, TINY["vocab_size"], (batch, length), generator=generator, device="cpu").to(self.device)

    def positions(self, start: int, length: int, batch: int = 1) -> torch.Tensor:
        """Positions start, start + 1, ... for every row."""
        return torch.arange(start, start + length, device=self.device).expand(batch, -1)


@contextlib.contextmanager
def registered_for_test(name: str, cls: type[PositionalEncoding]) -> Iterator[Subject]:
    """Register `cls` as `name` for the duration of a `with` block (a test's own encoding), yielding its `Subject`;
    ValueError when `name` is taken."""
    if is_registered(name):
        raise ValueError(f"encoding {name!r} is already registered; a test's own encoding needs a name of its own")
    register_encoding(name, cls)
    try:
        yield Subject(name)
    finally:
        unregister_encoding(name)


def tiny_config(pe_type: str, **overrides) -> TapeConfig:
    """The kit's tiny `TapeConfig` for `pe_type`: `TINY`, every registered encoding's `test_options`, `overrides`."""
    options = {name: value for cls in registered().values() for name, value in cls.test_options.items()}
    return TapeConfig(**{**TINY, **options, "pe_type": pe_type, **overrides})


def randomize(model: torch.nn.Module, std: float = 0.3, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (zero-initialised ones included) random non-zero values of scale `std`, norms near 1,
    drawn on the CPU (the same values on every device)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64, device="cpu").to(
                param.device, param.dtype
            )
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.1 * noise)
            elif "dense" in name:
                param.add_(0.1 * noise)
            else:
                param.copy_(std * noise)
    return model


def difference(law: str, what: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: float = TOLERANCE):
    """The largest absolute difference of two tensors; LawFailure naming `law` and `what` when it exceeds
    `tolerance` or the shapes differ."""
    if actual.shape != expected.shape:
        raise LawFailure(f"{law}: {what}: shapes differ, {tuple(actual.shape)} against {tuple(expected.shape)}")
    measured = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    if not measured <= tolerance:  # NaN fails too
        raise LawFailure(f"{law}: {what} differ by {measured:.3g} (allowed {tolerance:g})")
    return measured


def same_tokens(law: str, what: str, actual: torch.Tensor, expected: torch.Tensor) -> float:
    """0 when two generations are the same tokens; LawFailure naming the first position where they differ."""
    if actual.shape != expected.shape or not torch.equal(actual, expected):
        where = "their lengths" if actual.shape != expected.shape else f"position {_first_difference(actual, expected)}"
        raise LawFailure(f"{law}: {what} generate different tokens (first at {where})")
    return 0.0


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).any(0).nonzero()[0])


def decode_in_chunks(model, ids: torch.Tensor, chunks, cache=None, position_ids: torch.Tensor | None = None):
    """The logits of `ids` fed through a cache (default: a new dynamic one) in consecutive chunks of these sizes."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    outputs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            positions = None if position_ids is None else position_ids[:, start : start + size]
            outputs.append(
                model(ids[:, start : start + size], position_ids=positions, cache=cache, use_cache=True).logits
            )
            start += size
    return torch.cat(outputs, dim=1)


def law_causal(subject: Subject) -> float:
    """Changing token n leaves every output before n as it was."""
    model, ids = subject.model(), subject.tokens(2, 12)
    largest = 0.0
    with torch.no_grad():
        full = model(ids).logits
        for n in (0, 5, 11):
            changed = ids.clone()
            changed[:, n] = (changed[:, n] + 1) % TINY["vocab_size"]
            what = f"outputs before token {n} with token {n} changed and as they were"
            largest = max(largest, difference("causal", what, model(changed).logits[:, :n], full[:, :n], 0.0))
    return largest


def law_cache_step(subject: Subject) -> float:
    """Decoding with a cache, one token at a time or in chunks, gives the full pass's logits at every position."""
    model, ids = subject.model(), subject.tokens(2, 18)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    one = difference(
        "cache_step", "one token at a time and the full pass", decode_in_chunks(model, ids, [1] * 18), full
    )
    chunks = decode_in_chunks(model, ids, [7, 1, 1, 5, 4])
    return max(one, difference("cache_step", "chunks of 7, 1, 1, 5, 4 tokens and the full pass", chunks, full))


def law_static_cache(subject: Subject) -> float:
    """A static cache fed in chunks gives the full pass's logits."""
    model, ids = subject.model(), subject.tokens(2, 18)
    cache = StaticCache(config=model.config, max_cache_len=20)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    chunks = decode_in_chunks(model, ids, [7, 1, 1, 5, 4], cache)
    return difference("static_cache", "a static cache fed in chunks and the full pass", chunks, full)


def law_generation(subject: Subject) -> float:
    """Greedy generation gives the same tokens with a dynamic cache, without a cache and with a static cache (also
    with left padding and with beam search)."""
    model, ids = subject.model(), subject.tokens(2, 6)
    greedy = dict(max_new_tokens=10, do_sample=False)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    for options in (dict(), dict(attention_mask=mask), dict(num_beams=3)):
        dynamic = model.generate(ids, **greedy, **options)
        if not options:
            uncached = model.generate(ids, use_cache=False, **greedy)
            same_tokens("generation", "a dynamic cache and no cache", dynamic, uncached)
        static = model.generate(ids, cache_implementation="static", **greedy, **options)
        same_tokens("generation", f"a static and a dynamic cache ({_spelled(options)})", static, dynamic)
    return 0.0


def _spelled(options: dict) -> str:
    spelled = ("left padding" if name == "attention_mask" else f"{name}={value}" for name, value in options.items())
    return ", ".join(spelled) or "plain"


def law_left_padding(subject: Subject) -> float:
    """A row alone computes (and generates) what it does left-padded in a batch beside a longer row."""
    model = subject.model()
    long, short, pad = subject.tokens(1, 12, seed=1), subject.tokens(1, 7, seed=2), 5
    batch = torch.cat([long, torch.cat([torch.zeros_like(short[:, :pad]), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    with torch.no_grad():
        logits = model(batch, attention_mask=mask).logits
        largest = max(
            difference("left_padding", "the longer row in the batch and alone", logits[0], model(long).logits[0]),
            difference("left_padding", "the left-padded row and alone", logits[1, pad:], model(short).logits[0]),
        )
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    alone = model.generate(short, max_new_tokens=6, do_sample=False)
    same_tokens("left_padding", "the left-padded row and the row alone", generated[1:, pad:], alone)
    return largest


def forward_and_gradients(model, ids: torch.Tensor, weights: torch.Tensor, **inputs):
    """Logits and every parameter's gradient of sum(logits * weights)."""
    model.zero_grad()
    logits = model(ids, **inputs).logits
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def check_packed_row(law: str, model, documents: list[torch.Tensor], weights: torch.Tensor, **inputs) -> float:
    """A row packing `documents` (positions restarting at each, or as `inputs` say) computes the logits and every
    gradient of sum(logits * weights) that its documents compute alone."""
    ids = torch.cat(documents, dim=1)
    if not inputs:
        starts = [torch.arange(d.shape[1], device=ids.device) for d in documents]
        inputs = dict(position_ids=torch.cat(starts)[None])
    logits, grads = forward_and_gradients(model, ids, weights, **inputs)
    alone, alone_grads, start = [], {}, 0
    for document in documents:
        end = start + document.shape[1]
        document_logits, document_grads = forward_and_gradients(model, document, weights[:, start:end])
        alone.append(document_logits)
        for name, grad in document_grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + grad
        start = end
    largest = difference(law, "the packed row's logits and its documents' alone", logits, torch.cat(alone, dim=1))
    if grads.keys() != alone_grads.keys() or not grads:
        raise LawFailure(f"{law}: the packed row and its documents alone give gradients to other parameters")
    for name in grads:
        what = f"the gradients of {name} from the packed row and from its documents alone"
        largest = max(largest, difference(law, what, grads[name], alone_grads[name], 10 * TOLERANCE))
    return largest


def law_packed_documents(subject: Subject) -> float:
    """A row packing three documents (positions restarting at each) computes, forward and backward, what each
    document computes alone."""
    model = subject.model()
    documents = [subject.tokens(1, n, seed=i) for i, n in enumerate((5, 3, 7))]
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(1, 15, TINY["vocab_size"], dtype=torch.float64, generator=generator, device="cpu").to(
        subject.device
    )
    return check_packed_row("packed_documents", model, documents, weights)


def law_positions(subject: Subject) -> float:
    """Positions other than 0..n-1 are honoured: a cache decoding at an offset gives the full pass's logits at that
    offset; each row of a batch reads its own positions (an offset row, and a row of ids gathered from a longer range,
    each equal alone); an absolute encoding's outputs change when every position moves by 3,000 (it reads them)."""
    model, ids, n = subject.model(max_position_embeddings=4096), subject.tokens(2, 12), 12
    offset = subject.positions(37, n, 2)
    gathered = torch.tensor([[3, 4, 5, 9, 10, 20, 21, 22, 23, 40, 41, 90]], device=subject.device)
    rows = torch.cat([offset[:1], gathered])
    with torch.no_grad():
        full = model(ids, position_ids=offset).logits
        largest = difference(
            "positions",
            "chunked decoding from position 37 and the full pass there",
            decode_in_chunks(model, ids, [5, 1, 6], position_ids=offset),
            full,
        )
        batch = model(ids, position_ids=rows).logits
        for row, what in ((0, "a row at offset 37"), (1, "a row of gathered positions")):
            alone = model(ids[row : row + 1], position_ids=rows[row : row + 1]).logits[0]
            largest = max(largest, difference("positions", f"{what} in the batch and alone", batch[row], alone))
        if not encoding_class(subject.pe_type).relative:
            at = {start: model(ids, position_ids=subject.positions(start, n, 2)).logits for start in (0, 3000)}
            moved = (at[3000] - at[0]).abs().max().item()
            if moved <= TOLERANCE:
                raise LawFailure(
                    f"positions: an absolute encoding gives the same outputs at offsets 3000 and 0 (they differ by "
                    f"{moved:.3g}): it ignores the positions it is given"
                )
    return largest


def law_relative(subject: Subject) -> float:
    """Where the encoding declares itself relative: adding k to every position changes no output, for offsets up to
    3,000 (none or only one of the encodings named in a schedule may be absolute)."""
    if not all(encoding_class(name).relative for name in layer_encodings(subject.config())):
        return 0.0
    model, ids = subject.model(max_position_embeddings=4096), subject.tokens(2, 16)
    largest = 0.0
    with torch.no_grad():
        at_zero = model(ids, position_ids=subject.positions(0, 16, 2)).logits
        for shift in (1, 37, 3000):
            shifted = model(ids, position_ids=subject.positions(shift, 16, 2)).logits
            what = f"outputs at positions shifted by {shift} and unshifted"
            largest = max(largest, difference("relative", what, shifted, at_zero, 1e-9))
    return largest


def law_bf16_autocast(subject: Subject) -> float:
    """A training step under bf16 autocast, at positions beyond 4,096 (where bf16 positions are no longer exact),
    gives every trainable parameter a finite gradient."""
    model = subject.model(dtype=torch.float32, max_position_embeddings=8192).train()
    ids = subject.tokens(2, 32)
    with torch.autocast(subject.device.type, dtype=torch.bfloat16):
        model(ids, position_ids=subject.positions(4100, 32, 2), labels=ids).loss.backward()
    for name, param in model.named_parameters():
        if param.requires_grad and (param.grad is None or not torch.isfinite(param.grad).all()):
            state = "no gradient" if param.grad is None else "a gradient that is not finite"
            raise LawFailure(f"bf16_autocast: {name} gets {state} from a bf16-autocast step")
    return 0.0


def law_save_load(subject: Subject) -> float:
    """A model saved with save_pretrained loads through AutoModelForCausalLM to the same logits."""
    model, ids = subject.model(), subject.tokens(2, 10)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, use_kernels=False).eval()
    if not isinstance(loaded, TapeForCausalLM):
        raise LawFailure(f"save_load: AutoModelForCausalLM loaded a {type(loaded).__name__}, not a TapeForCausalLM")
    with torch.no_grad():
        return difference(
            "save_load", "the loaded model's logits and the saved one's", loaded(ids).logits, model(ids).logits, 0.0
        )


def law_compiles(subject: Subject, backend: str = "inductor") -> float:
    """torch.compile'd as one graph (`fullgraph=True`: no break), the model computes the eager model's logits
    (float32). `backend`: torch.compile's ("eager" checks the capture alone, without building code). One decoder
    layer (every layer is traced alike) unless the subject sets its own layers."""
    layers = {} if {"num_hidden_layers", "layer_pe_types"} & set(subject.options) else {"num_hidden_layers": 1}
    model, ids = subject.model(dtype=torch.float32, **layers), subject.tokens(2, 10)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        try:
            logits = compiled(ids).logits
        except Exception as error:  # dynamo's and the backends' errors have no common class
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            raise LawFailure(f"compiles: torch.compile cannot capture it ({type(error).__name__}: {reason})") from None
        return difference("compiles", f"compiled ({backend}) and eager logits", logits, model(ids).logits, 1e-4)


def law_gradcheck(subject: Subject) -> float:
    """torch.autograd.gradcheck in float64: the gradients of the logits with respect to the input embeddings and
    the encoding's own parameters are the numerical ones (a hand-written backward is right). The model normalises in
    float32, as transformers' Llama does whatever the dtype, so the finite differences take steps of 1e-4 and the
    comparison (of random projections: gradcheck's fast mode) allows 1e-3; a wrong backward is off by far more."""
    model, length = subject.model(), 5
    embeds = model.get_input_embeddings()(subject.tokens(1, length)).detach().requires_grad_()
    own = {name: p.detach().requires_grad_() for name, p in model.named_parameters() if ".positional." in f".{name}"}
    names = list(own)

    def logits(embeddings, *values):
        parameters = dict(zip(names, values))
        return torch.func.functional_call(model, parameters, (), dict(inputs_embeds=embeddings)).logits

    try:
        devices = [] if subject.device.type == "cpu" else [subject.device.index or 0]
        with torch.random.fork_rng(devices, device_type=subject.device.type):  # the same random projections
            torch.manual_seed(0)
            torch.autograd.gradcheck(logits, (embeds, *own.values()), eps=1e-4, atol=1e-3, rtol=1e-3, fast_mode=True)
    except GradcheckError as error:
        summary = " ".join(str(error).split())[:300]
        raise LawFailure(f"gradcheck: analytical and numerical gradients differ: {summary}") from None
    return 0.0


def law_position_limit(subject: Subject) -> float:
    """An encoding that declares `reads_position_limit` False starts from the same weights (the seed's
    initialisation, buffers included) and computes the same logits whatever `max_position_embeddings` and
    `randpe_max_position` say, so that runs differing only in their evaluation lengths can share one training;
    nothing to hold for one that declares True."""
    if encoding_class(subject.pe_type).reads_position_limit:
        return 0.0
    limit = TINY["max_position_embeddings"]
    limits = [{"max_position_embeddings": n, "randpe_max_position": n} for n in (limit, 4 * limit)]
    initial = []
    for sizes in limits:
        torch.manual_seed(0)
        with torch.device(subject.device):
            initial.append(TapeForCausalLM(subject.config(**sizes)).state_dict())
    if {name: value.shape for name, value in initial[0].items()} != {k: v.shape for k, v in initial[1].items()}:
        raise LawFailure("position_limit: the weights' names or shapes depend on max_position_embeddings")
    for name, value in initial[0].items():
        difference("position_limit", f"the initial {name}", initial[1][name].double(), value.double(), 0.0)
    ids = subject.tokens(2, min(limit, 12))
    with torch.no_grad():
        small, large = (subject.model(**sizes)(ids).logits for sizes in limits)
    return difference("position_limit", "logits at two position limits", large, small, 0.0)


LAWS: dict[str, Callable[[Subject], float]] = {
    "causal": law_causal,
    "cache_step": law_cache_step,
    "static_cache": law_static_cache,
    "generation": law_generation,
    "left_padding": law_left_padding,
    "packed_documents": law_packed_documents,
    "positions": law_positions,
    "relative": law_relative,
    "bf16_autocast": law_bf16_autocast,
    "save_load": law_save_load,
    "compiles": law_compiles,
    "gradcheck": law_gradcheck,
    "position_limit": law_position_limit,
}
"""Every law by name, in the order `check_encoding` runs them."""


@dataclass(frozen=True)
class Verdict:
    """One law's outcome for one encoding: whether it held, the largest difference measured, and why it failed."""

    law: str
    held: bool
    measured: float = math.nan
    failure: str = ""


def check_encoding(
    name: str,
    laws: list[str] | None = None,
    device: torch.device | str = "cpu",
    compile_backend: str = "inductor",
) -> list[Verdict]:
    """Run `laws` (default: every law in `LAWS`) on the encoding registered as `name`, on `device`, compiling with
    `compile_backend`; a law that raises anything fails. ValueError for an unknown encoding or law, before any law
    runs."""
    encoding_class(name)
    chosen = list(LAWS) if laws is None else laws
    unknown = [law for law in chosen if law not in LAWS]
    if unknown:
        raise ValueError(f"law {unknown[0]!r} is not allowed; choose from: {', '.join(LAWS)}")
    subject = Subject(name, torch.device(device))
    options = {"compiles": {"backend": compile_backend}}
    verdicts = []
    for law in chosen:
        try:
            verdicts.append(Verdict(law, True, LAWS[law](subject, **options.get(law, {}))))
        except LawFailure as failure:
            verdicts.append(Verdict(law, False, failure=str(failure)))
        except Exception as error:  # a law that crashes does not hold either
            reason = (str(error).strip().splitlines() or [""])[0][:300]
            verdicts.append(Verdict(law, False, failure=f"{law}: raised {type(error).__name__}: {reason}"))
    return verdicts


__all__ = [
    "LAWS",
    "TINY",
    "TOLERANCE",
    "LawFailure",
    "Subject",
    "Verdict",
    "check_encoding",
    "check_packed_row",
    "decode_in_chunks",
    "difference",
    "forward_and_gradients",
    "randomize",
    "registered_for_test",
    "tiny_config",
    "law_bf16_autocast",
    "law_cache_step",
    "law_causal",
    "law_compiles",
    "law_generation",
    "law_gradcheck",
    "law_left_padding",
    "law_packed_documents",
    "law_position_limit",
    "law_positions",
    "law_relative",
    "law_save_load",
    "law_static_cache",
]
