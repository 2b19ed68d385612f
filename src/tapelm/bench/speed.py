"""`tapelm bench speed`: every encoding timed side by side in one process, on the CPU or a GPU, quoted as ratios to
RoPE with an interval over repetitions.

Measurements are interleaved: one repetition visits every row (each encoding, and transformers' `LlamaForCausalLM`
of the same size as a peer) before the next starts, and in each visit RoPE and the row live side by side and every
timing alternates between them, so that a noisy machine slows both alike; a row's ratio to RoPE is taken from these
pairs in each repetition, and reported as the mean with its 95% interval over repetitions. Per row:

- a training step (forward, backward, AdamW; fused AdamW on CUDA), in float32 or under bf16 autocast (float32
  weights, as accelerate's mixed_precision="bf16" trains), optionally with `compile_layers()`; its tokens/s and the
  achieved TFLOP/s (model FLOPs: 6 x non-embedding parameters + 6 x layers x hidden x sequence length per token for
  causal attention, the same count for every row);
- peak training memory: from the device's allocator on a GPU (`max_memory_allocated`); counted on the CPU (weights,
  gradients, AdamW's two moments and every tensor autograd saves for the backward pass);
- prefill: the cached forward pass over the decoding prompt at batch 1 (the wait before the first new token);
- greedy decoding with a cache after that prompt, at batch 1 and 8: tokens/s (all rows of the batch) and the bytes
  the cache holds. RoPE and the row decode in alternating blocks of a few tokens, so that even the load's drift within
  a second slows both alike. With `--dtype bf16` the model decodes with bf16 weights; with `--compile` it decodes
  with a static cache and a compiled decode step (CUDA graphs on a GPU), except an encoding whose cache has no fixed
  shapes (PaTH), which decodes eagerly.

At most two workloads live at a time (rebuilt from the same seed at every visit and warmed up before they are
timed), so the large sizes fit; memory is measured with the row alone. A row that runs out of device memory is
reported as such and skipped in later repetitions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import Cache, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from ..analysis.statistics import interval
from ..config import TapeConfig
from ..fast_paths import NAMES as FAST_PATH_NAMES
from ..fast_paths import SETTINGS as FAST_PATH_SETTINGS
from ..fast_paths import check_setting
from ..kernels import fla_runs_on
from ..modeling import TapeForCausalLM
from ..positional import encoding_names
from ..training.provenance import environment, installed_version
from ..variants import GATED_SUFFIX, MECHANISMS, VARIANTS, gated_row, resolve_variant

PEERS = ("llama", "fla-fox", "fla-path")
"""Rows that are not tapelm encodings: `llama` is transformers' LlamaForCausalLM at the same size (RoPE);
`fla-fox` and `fla-path` are fla's own FoX and PaTH models at the same size (its Triton attention kernels and fused
RMSNorm, SwiGLU and cross-entropy), on CUDA with fla installed, training only (their decoding keeps fla's own cache)."""
FLA_PEERS = ("fla-fox", "fla-path")


@dataclass(frozen=True)
class SpeedSize:
    """One model size and workload of the benchmark."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    seq: int
    batch: int
    decode_context: int
    decode_tokens: int  # timed per model and repetition, in blocks of `DECODE_BLOCK`
    repeats: int
    vocab: int = 256
    decode_batches: tuple[int, ...] = (1, 8)

    def config(self, row: str, fast_paths="auto") -> TapeConfig:
        """An encoding or one of TAPE's variants (`tapelm.variants`) with the given fast-path setting.
        RandPE decodes on the given positions (a cache cannot be continued otherwise); it trains as always."""
        pe_type, options = resolve_variant(row)
        return TapeConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=max(4096, self.seq),
            pe_type=pe_type,
            randpe_eval_positions="given",
            fast_paths=fast_paths,
            **options,
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=max(4096, self.seq),
        )

    def fla_config(self, row: str):
        """fla's FoX (`fla-fox`) or PaTH (`fla-path`) model config at this size (fla installed)."""
        from fla.models import ForgettingTransformerConfig, PaTHAttentionConfig

        kind = ForgettingTransformerConfig if row == "fla-fox" else PaTHAttentionConfig
        return kind(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
        )

    def flops_per_token(self, non_embedding_parameters: int) -> float:
        """Training FLOPs per token: 6N for the weights, 6 x layers x hidden x seq for causal attention."""
        return 6 * non_embedding_parameters + 6 * self.layers * self.hidden * self.seq


SIZES = {
    "tiny": SpeedSize("tiny", 2, 32, 4, 2, 64, 16, 2, 24, 5, 2, decode_batches=(1, 2)),
    "quick": SpeedSize("quick", 6, 256, 8, 4, 688, 256, 8, 1024, 16, 3),
    "small": SpeedSize("small", 6, 256, 8, 4, 688, 512, 8, 2048, 64, 3),
    "large": SpeedSize("large", 12, 768, 12, 12, 2048, 1024, 1, 2048, 32, 3),
    # the paper's 12 x 768 model (the `paper` preset, 32k BPE vocabulary) and a 24 x 1024 GQA model, for GPUs
    "paper-1k": SpeedSize("paper-1k", 12, 768, 12, 12, 2048, 1024, 16, 2048, 64, 5, vocab=32000),
    "paper-4k": SpeedSize("paper-4k", 12, 768, 12, 12, 2048, 4096, 4, 2048, 64, 5, vocab=32000),
    "gqa-2k": SpeedSize("gqa-2k", 24, 1024, 16, 4, 2816, 2048, 8, 2048, 64, 5, vocab=32000),
}
CPU_SIZES = ("small", "large")
GPU_SIZES = ("paper-1k", "paper-4k", "gqa-2k")


@dataclass(frozen=True)
class Options:
    """How every row is run: the device, bf16 autocast (training) and bf16 weights (decoding), compiled layers, and
    the fast-path setting of tapelm's rows (`TapeConfig.fast_paths`: a setting or a tuple of path names; the peers
    have none)."""

    device: torch.device
    bf16: bool = False
    compile: bool = False
    compile_backend: str = "inductor"  # the tests use dynamo's own "eager": the same graph capture, no C++ build
    fast_paths: str | tuple[str, ...] = "auto"

    def autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def record(self) -> dict:
        return {
            **device_record(self.device),
            "dtype": "bf16" if self.bf16 else "float32",
            "compile": self.compile,
            "compile_backend": self.compile_backend,
            "fast_paths": self.fast_paths if isinstance(self.fast_paths, str) else list(self.fast_paths),
        }


def device_record(device: torch.device) -> dict:
    """The device, and for a GPU its name, memory, compute capability and CUDA version."""
    record = {"device": str(device)}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        record.update(
            device_name=properties.name,
            device_memory_bytes=properties.total_memory,
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            cuda=torch.version.cuda,
        )
    return record


def _saved_bytes(fn) -> int:
    """Bytes of distinct tensors autograd saves for backward while fn runs. Each is kept (so no storage is freed and
    its address reused while counting) as a detached alias: the tensor itself would close a cycle through its own
    grad_fn for an output saved by the operation that made it, which Python's collector cannot see, and the whole
    graph would never be freed."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


def cache_bytes(cache) -> int:
    """Bytes a cache holds: its keys and its value streams (a static cache's whole buffers)."""
    return sum(
        layer.held_bytes() if hasattr(layer, "held_bytes") else layer.keys.nbytes + layer.values.nbytes
        for layer in cache.layers
    )


def build_model(size: SpeedSize, row: str, fast_paths="auto") -> torch.nn.Module:
    """A tapelm encoding or variant with the given fast-path setting, or a peer (`PEERS`), at `size`, on the default
    device."""
    if row == "llama":
        return LlamaForCausalLM(size.llama_config())
    if row in FLA_PEERS:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(size.fla_config(row))
    return TapeForCausalLM(size.config(row, fast_paths))


class Workload:
    """One row at one size: a model on the device, its optimizer and fixed inputs."""

    def __init__(self, size: SpeedSize, row: str, options: Options, seed: int = 0):
        torch.manual_seed(seed)
        self.size, self.row, self.options = size, row, options
        with torch.device(options.device):
            self.model = build_model(size, row, options.fast_paths)
        if options.compile:
            if row == "llama" or row in FLA_PEERS:
                for layer in self.model.model.layers:
                    layer.compile(dynamic=True, backend=options.compile_backend)
            else:
                self.model.compile_layers(backend=options.compile_backend)
        fused = {"fused": True} if options.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **fused)
        generator = torch.Generator().manual_seed(seed)
        self.batch = torch.randint(0, size.vocab, (size.batch, size.seq), generator=generator).to(options.device)
        self.prompt = torch.randint(
            0, size.vocab, (max(size.decode_batches), size.decode_context), generator=generator
        ).to(options.device)

    def non_embedding_parameters(self) -> int:
        embeddings = {
            id(p)
            for module in (self.model.get_input_embeddings(), self.model.get_output_embeddings())
            for p in module.parameters()
        }
        return sum(p.numel() for p in self.model.parameters() if id(p) not in embeddings)

    def decode_weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads: every parameter in the decoding dtype but the input embeddings,
        of which it reads one row per token (the output projection's it reads whole, tied or not)."""
        output = self.model.get_output_embeddings().weight
        read = self.non_embedding_parameters() + output.numel()
        return read * (2 if self.options.bf16 else output.element_size())

    def train_step(self) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.options.synchronize()
        start = time.perf_counter()
        with self.options.autocast():
            loss = self.model(self.batch, labels=self.batch, use_cache=False).loss
        loss.backward()
        self.optimizer.step()
        self.options.synchronize()
        return time.perf_counter() - start

    def training_memory(self) -> int:
        """Peak bytes of a training step: the allocator's on a GPU, counted on the CPU."""
        if self.options.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.options.device)
            self.train_step()
            return torch.cuda.max_memory_allocated(self.options.device)
        self.model.train()
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        with self.options.autocast():
            saved = _saved_bytes(lambda: self.model(self.batch, labels=self.batch, use_cache=False).loss)
        return 4 * params + saved  # weights, gradients, AdamW's two moments, saved activations

    def for_decoding(self) -> None:
        """Eval mode, bf16 weights with --dtype bf16, the compiled decode step with --compile; training state
        dropped."""
        self.optimizer = None
        self.model.zero_grad(set_to_none=True)
        self.model.eval()
        if self.options.bf16:
            self.model.to(torch.bfloat16)
        if self.compiles_decoding:  # the whole decode step as one graph: on a model whose layers are not compiled
            self.model = self._uncompiled_copy()
            mode = "reduce-overhead" if self.options.device.type == "cuda" else None  # CUDA graphs on a GPU
            self.step = torch.compile(
                self.model, dynamic=False, fullgraph=True, mode=mode, backend=self.options.compile_backend
            )
        else:
            self.step = self.model

    def _uncompiled_copy(self) -> torch.nn.Module:
        """The model with the same weights and dtype, its layers not compiled, in eval mode."""
        with torch.device(self.options.device):
            copy = build_model(self.size, self.row, self.options.fast_paths)
        copy.to(next(self.model.parameters()).dtype).load_state_dict(self.model.state_dict())
        return copy.eval()

    @property
    def compiles_decoding(self) -> bool:
        """--compile, and a cache with fixed shapes (transformers' Llama's static cache; every tapelm encoding but
        PaTH's)."""
        positional = getattr(self.model.model, "positional", None)
        return self.options.compile and (positional is None or positional.fixed_shape_cache)

    def _forward(self, ids, cache):
        return self.model(ids, use_cache=True, cache=cache)

    @torch.no_grad()
    def prefill(self) -> float:
        """Seconds of the cached forward pass over the prompt at batch 1."""
        self.options.synchronize()
        start = time.perf_counter()
        self._forward(self.prompt[:1], DynamicCache(config=self.model.config))
        self.options.synchronize()
        return time.perf_counter() - start

    @torch.no_grad()
    def start_decoding(self, batch: int, steps: int) -> Decoding:
        """The prompt prefilled at `batch` rows and the untimed first steps taken, ready for `steps` more decoding
        steps (a static cache is sized for them). The prompt is prefilled in chunks of 512 tokens (as serving does),
        so that encodings that build a logit-sized tensor per layer (CoPE's gates) fit at batch 8; the untimed steps
        are the first new token, and the first three of a compiled decode step (compiling, CUDA graphs' warm-up and
        recording); a compiled step runs as one graph (`fullgraph`): a graph break is an error."""
        prompt = self.prompt[:batch]
        untimed = 3 if self.compiles_decoding else 1
        if self.compiles_decoding:
            cache = StaticCache(config=self.model.config, max_cache_len=prompt.shape[1] + untimed + steps + 1)
        else:
            cache = DynamicCache(config=self.model.config)
        for start in range(0, prompt.shape[1], 512):
            logits = self._forward(prompt[:, start : start + 512], cache).logits
        decoding = Decoding(self, cache, logits[:, -1:].argmax(-1), cache_bytes(cache))
        decoding.steps(untimed)
        return decoding


@dataclass
class Decoding:
    """Greedy cached decoding of one workload under way: its cache, the next input token, the bytes the cache held
    after the prompt (a static cache's whole buffers, which its attention reads), and the timed tokens and seconds
    so far."""

    workload: Workload
    cache: Cache
    token: torch.Tensor
    held_bytes: int
    timed_tokens: int = 0
    seconds: float = 0.0

    @torch.no_grad()
    def steps(self, count: int) -> float:
        """Decode `count` tokens; return the seconds they took (the device synchronised before and after). A compiled
        step runs compiled; eager layers under the eager stance (compiled layers' shapes change at every step)."""
        workload = self.workload
        stance = "default" if workload.compiles_decoding else "force_eager"
        with torch.compiler.set_stance(stance):
            workload.options.synchronize()
            start = time.perf_counter()
            for _ in range(count):
                self.token = workload.step(self.token, use_cache=True, cache=self.cache).logits[:, -1:].argmax(-1)
            workload.options.synchronize()
        return time.perf_counter() - start

    def block(self, tokens: int) -> None:
        """One untimed step, which brings this model's weights and cache back into the CPU's caches after another
        model's block, then `tokens` timed steps."""
        self.steps(1)
        self.seconds += self.steps(tokens)
        self.timed_tokens += tokens * self.token.shape[0]

    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.seconds


DECODE_BLOCK = 8
"""Timed decoding steps per block of `paired_decoding`."""


def paired_decoding(workloads: list[Workload], batch: int) -> list[Decoding]:
    """Each workload's greedy cached decoding after the prompt at `batch` rows, the workloads taking turns in blocks
    of `DECODE_BLOCK` timed steps (each after an untimed one) until each has timed the size's `decode_tokens`: the
    machine's load, which drifts within a second on a shared machine, then slows both alike, while each block still
    decodes as a model alone does, from its own warm caches."""
    size = workloads[0].size
    blocks = [DECODE_BLOCK] * (size.decode_tokens // DECODE_BLOCK)
    blocks += [size.decode_tokens % DECODE_BLOCK] if size.decode_tokens % DECODE_BLOCK else []
    decodings = [workload.start_decoding(batch, sum(blocks) + len(blocks)) for workload in workloads]
    for tokens in blocks:
        for decoding in decodings:
            decoding.block(tokens)
    return decodings


def _decode_key(batch: int) -> str:
    return f"decode_tokens_per_s_batch{batch}"


def _timed_keys(size: SpeedSize) -> tuple[str, ...]:
    return ("train_step_s", "prefill_s", *(_decode_key(b) for b in size.decode_batches))


def _alone(size: SpeedSize, row: str, options: Options) -> dict:
    """What does not vary between repetitions, measured with the row alone on the device: peak training memory,
    parameters, FLOPs per token."""
    workload = Workload(size, row, options)
    try:
        workload.train_step()
        return {
            "train_memory_bytes": workload.training_memory(),
            "parameters": sum(p.numel() for p in workload.model.parameters()),
            "decode_weight_bytes": workload.decode_weight_bytes(),
            "flops_per_token": size.flops_per_token(workload.non_embedding_parameters()),
        }
    finally:
        del workload
        _free(options)


def _paired_visit(size: SpeedSize, row: str, options: Options) -> tuple[dict, dict]:
    """One repetition of `row` beside RoPE: both models alive, every timing taken in alternation (RoPE's, then the
    row's), so the ratio of a pair is not moved by the machine's load drifting between visits. Returns the row's
    timings and RoPE's paired ones (training and prefill: the best of two alternations each; decoding: the tokens/s of
    alternating blocks, `paired_decoding`), with the caches' bytes."""
    workloads = [Workload(size, "rope", options), Workload(size, row, options)]
    try:
        for workload in workloads:
            workload.train_step()  # warm-up: first-call allocations, kernel selection, compilation
        timings = [{"train_step_s": min(values)} for values in _alternate(workloads, Workload.train_step)]
        if trains_only(row):
            return timings[1], timings[0]
        for workload in workloads:
            workload.for_decoding()
        with torch.compiler.set_stance("force_eager"):  # decoding shapes change at every step
            for workload in workloads:
                workload.prefill()
            for timing, values in zip(timings, _alternate(workloads, Workload.prefill)):
                timing["prefill_s"] = min(values)
            for batch in size.decode_batches:
                for timing, decoding in zip(timings, paired_decoding(workloads, batch)):
                    timing[_decode_key(batch)] = decoding.tokens_per_s()
                    timing[f"cache_bytes_batch{batch}"] = decoding.held_bytes
        return timings[1], timings[0]
    finally:
        del workloads
        _free(options)


def _alternate(workloads: list[Workload], measure_one, rounds: int = 2) -> list[list]:
    """Each workload's measurements, taken in turns `rounds` times."""
    values: list[list] = [[] for _ in workloads]
    for _ in range(rounds):
        for i, workload in enumerate(workloads):
            values[i].append(measure_one(workload))
    return values


def trains_only(row: str) -> bool:
    """Rows timed in training only: fla's models (their decoding keeps fla's own cache)."""
    return row in FLA_PEERS


def _free(options: Options) -> None:
    if options.device.type == "cuda":
        torch.cuda.empty_cache()


def _out_of_memory(error: BaseException) -> bool:
    message = str(error).lower()
    return (
        isinstance(error, torch.cuda.OutOfMemoryError)
        or "out of memory" in message
        or "can't allocate memory" in message
    )


def _compile_budget():
    """Enough compiled versions per layer that no row's compiled layers fall back to eager (dynamo keeps 8)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(64, getattr(config, name))})


def measure(size: SpeedSize, rows: list[str], options: Options, progress: bool = True, update=None) -> dict[str, dict]:
    """Per row: its memory (measured alone), its median timings, and per repetition its timings and RoPE's taken in
    alternation with it (`samples`, `rope_samples`). Repetitions visit every row in turn. RoPE's own timings are the
    median of all its paired ones. A row that runs out of memory is {"error": ...} and is not visited again.
    `update(results)`, where given, receives the results so far after every row's measurement (a row not yet
    visited holds what was measured of it alone, `"repetitions": 0`)."""
    others = [row for row in rows if row != "rope"] or ["rope"]
    samples: dict[str, list[dict]] = {row: [] for row in others}
    paired: dict[str, list[dict]] = {row: [] for row in others}
    static: dict[str, dict] = {}
    failed: dict[str, str] = {}
    steps = tqdm(total=size.repeats * len(others) + len(rows), desc=f"speed {size.name}", disable=not progress)

    def attempt(row: str, work) -> None:
        if row in failed:
            return
        try:
            work()
        except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
            if not _out_of_memory(error):
                raise
            failed[row] = f"out of memory: {str(error).splitlines()[0][:200]}"
            _free(options)
        steps.update()
        if update is not None:
            update(_summary(size, rows, static, samples, paired, failed))

    with _compile_budget():
        for row in rows:
            attempt(row, lambda r=row: static.__setitem__(r, _alone(size, r, options)))
        for _ in range(size.repeats):
            for row in others:

                def visit(r=row):
                    mine, rope = _paired_visit(size, r, options)
                    samples[r].append(mine)
                    paired[r].append(rope)

                attempt(row, visit)
    steps.close()
    return _summary(size, rows, static, samples, paired, failed)


def _summary(
    size: SpeedSize, rows: list[str], static: dict, samples: dict, paired: dict, failed: dict
) -> dict[str, dict]:
    """`measure`'s results from what was measured so far."""
    others = list(samples)
    if "rope" in failed:
        return {
            row: {"error": failed.get(row, "not measured: RoPE, every row's reference, " + failed["rope"])}
            for row in rows
        }
    rope_timings = [sample for row in others if row not in failed and not trains_only(row) for sample in paired[row]]
    rope_timings = rope_timings or [sample for row in others if row not in failed for sample in paired[row]]
    results: dict[str, dict] = {}
    for row in rows:
        if row in failed:
            results[row] = {"error": failed[row]}
            continue
        if row not in static:
            continue
        mine = rope_timings if row == "rope" else samples[row]
        result = {**static[row], "repetitions": len(mine)}
        if not mine:
            results[row] = result
            continue
        for key in _timed_keys(size):
            if key in mine[0]:
                result[key] = statistics.median(sample[key] for sample in mine)
        for batch in size.decode_batches:
            if f"cache_bytes_batch{batch}" in mine[0]:
                result[f"cache_bytes_batch{batch}"] = mine[0][f"cache_bytes_batch{batch}"]
        result["tokens_per_s"] = size.batch * size.seq / result["train_step_s"]
        result["tflops"] = result["flops_per_token"] * result["tokens_per_s"] / 1e12
        if row != "rope":
            result["samples"], result["rope_samples"] = samples[row], paired[row]
        results[row] = result
    return results


def ratios_to_rope(size: SpeedSize, results: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """Each row's ratio to RoPE: timings against RoPE's taken in alternation with them, per repetition (mean and
    95% interval over repetitions); memory and cache bytes once (they do not vary). `decode_bytes_bound_batchB` is
    the tokens/s ratio a decoder bound by bytes would reach: RoPE's bytes read per decode step (weights and cache) over
    the row's."""
    rope = results.get("rope", {"error": "not measured yet"})
    ratios: dict[str, dict[str, dict]] = {}
    for row, result in results.items():
        if "error" in result or "error" in rope:
            continue
        if row == "rope":
            ratios[row] = {key: {"mean": 1.0, "n": size.repeats} for key in _timed_keys(size) if key in result}
        else:
            ratios[row] = {
                key: interval(
                    [mine[key] / theirs[key] for mine, theirs in zip(result["samples"], result["rope_samples"])]
                )
                for key in _timed_keys(size)
                if key in result
            }
        for key in ("train_memory_bytes", *(f"cache_bytes_batch{b}" for b in size.decode_batches)):
            if key in result:
                ratios[row][key] = {"mean": result[key] / rope[key], "n": 1}
        for batch in size.decode_batches:
            if f"cache_bytes_batch{batch}" in result and "decode_weight_bytes" in result:
                bound = _bytes_per_step(rope, batch) / _bytes_per_step(result, batch)
                ratios[row][f"decode_bytes_bound_batch{batch}"] = {"mean": bound, "n": 1}
    return ratios


def _bytes_per_step(result: dict, batch: int) -> int:
    """Bytes a decode step at `batch` reads: the weights and the whole cache."""
    return result["decode_weight_bytes"] + result[f"cache_bytes_batch{batch}"]


def _ratio(entry: dict | None) -> str:
    if entry is None:
        return "–"
    half = entry.get("half_width")
    return f"{entry['mean']:.2f}" + (f" ± {half:.2f}" if half is not None and half == half else "")


def _number(result: dict, key: str, factor: float = 1.0) -> str:
    return f"{result[key] * factor:,.1f}" if key in result else "–"


def format_table(size: SpeedSize, report_entry: dict) -> str:
    """A markdown table: absolute numbers and ratios to RoPE (mean ± 95% interval over repetitions)."""
    results, ratios = report_entry["results"], report_entry["ratios_to_rope"]
    memory = "peak MB" if report_entry["options"]["device"].startswith("cuda") else "counted MB"
    decode = [f"decode tok/s b{b}" for b in size.decode_batches]
    lines = [
        f"{size.name}: {size.layers} layers / hidden {size.hidden} / {size.heads} heads ({size.kv_heads} kv) / "
        f"vocab {size.vocab} / seq {size.seq} / batch {size.batch}; decode after {size.decode_context} tokens; "
        f"{report_entry['options']['device']}, {report_entry['options']['dtype']}"
        f"{', compiled layers' if report_entry['options']['compile'] else ''}"
        f"{_fast_paths_label(report_entry['options'])}; {size.repeats} repetitions",
        "",
        "| row | params | train step (ms) | x RoPE | tokens/s | TFLOP/s | train " + memory + " | x RoPE | "
        "prefill (ms) | x RoPE | " + " | ".join(f"{d} | x RoPE" for d in decode) + " | cache b1 (MB) | x RoPE |",
        "|---|" + "---:|" * (11 + 2 * len(decode)),
    ]
    for row, result in results.items():
        if "error" in result:
            lines.append(f"| {row} | {result['error']} |" + " |" * (10 + 2 * len(decode)))
            continue
        r = ratios.get(row, {})
        first = size.decode_batches[0]
        decode_cells = " | ".join(
            f"{_number(result, _decode_key(b))} | {_ratio(r.get(_decode_key(b)))}"
            f"{_bound(r.get(f'decode_bytes_bound_batch{b}'))}"
            for b in size.decode_batches
        )
        lines.append(
            f"| {row} | {result['parameters'] / 1e6:.2f}M | {result['train_step_s'] * 1e3:,.1f} | "
            f"{_ratio(r.get('train_step_s'))} | {result['tokens_per_s']:,.0f} | {result['tflops']:.2f} | "
            f"{result['train_memory_bytes'] / 2**20:,.0f} | {_ratio(r.get('train_memory_bytes'))} | "
            f"{_number(result, 'prefill_s', 1e3)} | {_ratio(r.get('prefill_s'))} | {decode_cells} | "
            f"{_number(result, f'cache_bytes_batch{first}', 2**-20)} | {_ratio(r.get(f'cache_bytes_batch{first}'))} |"
        )
    return "\n".join(lines)


def _bound(entry: dict | None) -> str:
    """(bytes bound B): the tokens/s ratio a decoder bound by the bytes it reads would reach; nothing where it is 1."""
    return "" if entry is None or round(entry["mean"], 2) == 1 else f" (bytes bound {entry['mean']:.2f})"


def _fast_paths_label(options: dict) -> str:
    setting = options.get("fast_paths", "auto")
    if setting == "auto":
        return ""
    return f", fast paths {setting if isinstance(setting, str) else ', '.join(setting) or 'none'}"


def plot(report: dict, path: Path) -> None:
    """Ratios to RoPE with their 95% intervals, one panel per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report["sizes"]
    fig, axes = plt.subplots(len(sizes), 1, figsize=(12, 3.8 * len(sizes)), squeeze=False)
    for axis, (name, entry) in zip(axes[:, 0], sizes.items()):
        ratios = entry["ratios_to_rope"]
        rows = list(ratios)
        batches = entry["settings"]["decode_batches"]
        keys = ("train_step_s", "train_memory_bytes", "prefill_s", *(_decode_key(b) for b in batches))
        labels = ("train step time", "train memory", "prefill time", *(f"decode tokens/s, batch {b}" for b in batches))
        width = 0.8 / len(keys)
        for i, (key, label) in enumerate(zip(keys, labels)):
            means = [ratios[row].get(key, {"mean": float("nan")})["mean"] for row in rows]
            errors = [ratios[row].get(key, {}).get("half_width", 0.0) for row in rows]
            errors = [0.0 if e != e else e for e in errors]
            axis.bar([j + i * width for j in range(len(rows))], means, width, yerr=errors, capsize=2, label=label)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], rows)
        axis.set_ylabel("ratio to tapelm's RoPE")
        options = entry["options"]
        axis.set_title(
            f"{name}: {entry['settings']['layers']} layers, hidden {entry['settings']['hidden']}, seq "
            f"{entry['settings']['seq']} x batch {entry['settings']['batch']}; "
            f"{options.get('device_name', options['device'])}, {options['dtype']}"
            f"{', compiled' if options['compile'] else ''}",
            fontsize=9,
        )
        axis.legend(fontsize=7, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_rows(rows: list[str], device: torch.device) -> list[str]:
    """The rows to measure, RoPE first; ValueError naming an unknown one, or an fla row where fla cannot run."""
    encodings = [*encoding_names(), *MECHANISMS]
    unknown = [row for row in rows if row not in (*encodings, *VARIANTS, *PEERS) and gated_row(row) is None]
    if unknown:
        raise ValueError(
            f"unknown row {unknown[0]!r}; choose from the encodings {', '.join(encodings)}, any encoding gated (its "
            f"name + '{GATED_SUFFIX}'), TAPE's variants {', '.join(VARIANTS)} and the peers {', '.join(PEERS)}"
        )
    fla_rows = [row for row in rows if row in FLA_PEERS]
    if fla_rows and not fla_runs_on(device):
        raise ValueError(
            f"row {fla_rows[0]!r} runs fla's Triton kernels: it needs a CUDA device and fla installed "
            f"(pip install tapelm[gpu]); this is {device.type}, fla "
            f"{'installed' if importlib.util.find_spec('fla') else 'not installed'}"
        )
    return ["rope", *[row for row in dict.fromkeys(rows) if row != "rope"]]


def check_device(name: str) -> torch.device:
    """The device `--device` names; ValueError when this PyTorch cannot use it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this PyTorch ({torch.__version__}) sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return device


def run(
    sizes: list[SpeedSize],
    rows: list[str],
    out_dir: Path,
    options: Options,
    progress: bool = True,
    stem: str | None = None,
) -> dict:
    """Measure every size, print the tables, write the JSON after every row's measurement (each size's entry
    `"complete": false` until its last repetition) and a PNG after each size (default name speed-DEVICE-SIZES);
    returns the report."""
    rows = check_rows(rows, options.device)
    report = {
        "environment": {**environment(), "fla": installed_version("flash-linear-attention")},
        "options": options.record(),
        "sizes": {},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / (stem or f"speed-{options.device.type}-{'-'.join(size.name for size in sizes)}")
    for size in sizes:  # the JSON is written after every row's measurement, so a run stopped early keeps it

        def write(results: dict, complete: bool, size=size) -> dict:
            entry = {
                "settings": asdict(size),
                "options": options.record(),
                "complete": complete,
                "results": results,
                "ratios_to_rope": ratios_to_rope(size, results),
            }
            report["sizes"][size.name] = entry
            temporary = stem.with_suffix(".json.tmp")
            temporary.write_text(json.dumps(report, indent=1))
            temporary.replace(stem.with_suffix(".json"))
            return entry

        entry = write(measure(size, rows, options, progress, update=lambda results: write(results, False)), True)
        print(format_table(size, entry), flush=True)
        print(flush=True)
        plot(report, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return report


def _bench_speed(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads} is not allowed; it must be a positive integer")
        torch.set_num_threads(args.threads)
    device = check_device(args.device)
    fast_paths = fast_path_setting(args.fast_paths)
    options = Options(device, bf16=args.dtype == "bf16", compile=args.compile, fast_paths=fast_paths)
    if args.quick:
        sizes = ["quick"]
    else:
        sizes = args.sizes or list(GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} is not allowed; it must be a positive integer")
    rows = args.pe or [*encoding_names(), *(peer for peer in PEERS if peer not in FLA_PEERS or fla_runs_on(device))]
    chosen = [SIZES[name] if args.repeats is None else replace(SIZES[name], repeats=args.repeats) for name in sizes]
    run(chosen, rows, Path(args.out), options, progress=not args.no_progress)


def fast_path_setting(words: list[str]) -> str | tuple[str, ...]:
    """`--fast-paths` as `TapeConfig.fast_paths` takes it: one of the settings, or a tuple of path names; a
    ValueError names what is wrong."""
    setting = words[0] if len(words) == 1 and words[0] in FAST_PATH_SETTINGS else tuple(words)
    check_setting(setting)
    return setting


def add_arguments(bench) -> None:
    """Register `tapelm bench speed` under `tapelm bench`."""
    speed = bench.add_parser(
        "speed",
        help="training, prefill and decode speed and memory of every encoding (and "
        "transformers' Llama), as ratios to RoPE, on the CPU or a GPU",
    )
    speed.add_argument(
        "--quick",
        action="store_true",
        help="one small size with short sequences (a table in about two minutes on 2 CPU cores)",
    )
    speed.add_argument(
        "--sizes",
        nargs="+",
        choices=list(SIZES),
        help=f"sizes to measure (default: {' '.join(CPU_SIZES)} on the CPU, {' '.join(GPU_SIZES)} on a GPU)",
    )
    speed.add_argument(
        "--pe",
        nargs="+",
        metavar="ROW",
        help=f"rows (default: every encoding, {', '.join(encoding_names())}, and the peers "
        f"{', '.join(PEERS)}; TAPE's variants too, e.g. tape-attention-only); RoPE is always "
        "included",
    )
    speed.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    speed.add_argument(
        "--dtype",
        choices=("float32", "bf16"),
        default="float32",
        help="float32, or bf16: training under bf16 autocast, decoding with bf16 weights (default: %(default)s)",
    )
    speed.add_argument(
        "--compile",
        action="store_true",
        help="train with compile_layers() (torch.compile per decoder layer), and decode with a static "
        "cache and the decode step compiled as one graph (CUDA graphs on a GPU; PaTH decodes "
        "eagerly)",
    )
    speed.add_argument(
        "--fast-paths",
        nargs="+",
        default=["auto"],
        metavar="SETTING_OR_PATH",
        help="tapelm's fast paths for every tapelm row, RoPE's and TAPE's alike: auto (those verified "
        "on the device), on (every one the device offers: how a GPU visit measures the ones not "
        "yet verified), off (the reference paths), or path names to run exactly those "
        f"({', '.join(FAST_PATH_NAMES)}) (default: auto)",
    )
    speed.add_argument("--repeats", type=int, help="repetitions (default: the size's; one gives no interval)")
    speed.add_argument("--out", default="bench-results", help="folder for the JSON and PNG (default: %(default)s)")
    speed.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    speed.add_argument("--no-progress", action="store_true", help="no progress bar")
    speed.set_defaults(handler=_bench_speed)
