"""`tapelm bench speed`: every encoding timed side by side in one process, quoted as ratios to RoPE.

Measurements are interleaved (one repetition visits every encoding before the next repetition starts) so that a noisy
machine slows all encodings alike; each number is the median over repetitions. Memory is counted, not sampled:
parameters, gradients and AdamW's two moments plus every tensor autograd saves for the backward pass (the part that
differs between encodings), and the cache after prefill for decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import PE_TYPES, TapeConfig
from ..experiments.provenance import environment
from ..modeling import TapeForCausalLM


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
    decode_tokens: int
    repeats: int

    def config(self, pe_type: str) -> TapeConfig:
        """RandPE decodes on the given positions (a cache cannot be continued otherwise); it trains as always."""
        return TapeConfig(vocab_size=256, hidden_size=self.hidden, intermediate_size=self.intermediate,
                          num_hidden_layers=self.layers, num_attention_heads=self.heads,
                          num_key_value_heads=self.kv_heads, max_position_embeddings=4096, pe_type=pe_type,
                          randpe_eval_positions="given")


SIZES = {
    "small": SpeedSize("small", 6, 256, 8, 4, 688, 512, 8, 2048, 32, 3),
    "large": SpeedSize("large", 12, 768, 12, 12, 2048, 1024, 1, 2048, 32, 3),
    "quick": SpeedSize("quick", 6, 256, 8, 4, 688, 256, 8, 1024, 16, 3),
}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _saved_bytes(fn) -> int:
    """Bytes of distinct tensors autograd saves for backward while fn runs."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


class Workload:
    """One encoding at one size: a model, its optimizer and fixed inputs."""

    def __init__(self, size: SpeedSize, pe_type: str, seed: int = 0):
        torch.manual_seed(seed)
        self.size = size
        self.model = TapeForCausalLM(size.config(pe_type))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(seed)
        self.batch = torch.randint(0, 256, (size.batch, size.seq), generator=generator)
        self.context = torch.randint(0, 256, (1, size.decode_context), generator=generator)

    def train_step(self) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.batch, labels=self.batch, use_cache=False).loss.backward()
        self.optimizer.step()

    @torch.no_grad()
    def prefill(self) -> None:
        self.model.eval()
        self.model(self.batch, use_cache=False)

    @torch.no_grad()
    def decode(self) -> tuple[float, int]:
        """Seconds per token of greedy decoding after a cached prefill of decode_context tokens, and cache bytes."""
        self.model.eval()
        out = self.model(self.context, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        cache_bytes = sum(layer.held_bytes() for layer in cache.layers)
        start = time.perf_counter()
        for _ in range(self.size.decode_tokens):
            out = self.model(token, cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / self.size.decode_tokens, cache_bytes

    def training_memory(self) -> int:
        self.model.train()
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        saved = _saved_bytes(lambda: self.model(self.batch, labels=self.batch, use_cache=False).loss)
        return 4 * params + saved  # weights, gradients, AdamW's two moments, saved activations


def measure(size: SpeedSize, pe_types: list[str], progress: bool = True) -> dict[str, dict]:
    """Median timings and counted memory per encoding, interleaved across encodings.

    One workload lives at a time (eleven large models with AdamW state do not fit in 24 GB), rebuilt from the same
    seed at every visit and warmed up before it is timed."""
    samples = {pe: {"train_step_s": [], "prefill_s": [], "decode_s_per_token": []} for pe in pe_types}
    results: dict[str, dict] = {}
    steps = tqdm(total=size.repeats * len(pe_types), desc=f"speed {size.name}", disable=not progress)
    for repeat in range(size.repeats):
        for pe in pe_types:
            workload = Workload(size, pe)
            workload.train_step()  # warm-up: first-call allocations and kernel selection
            workload.prefill()
            samples[pe]["train_step_s"].append(_timed(workload.train_step))
            samples[pe]["prefill_s"].append(_timed(workload.prefill))
            seconds, cache_bytes = workload.decode()
            samples[pe]["decode_s_per_token"].append(seconds)
            if repeat == 0:
                results[pe] = {"train_memory_bytes": workload.training_memory(), "cache_bytes": cache_bytes,
                               "parameters": workload.model.num_parameters()}
            del workload
            steps.update()
    steps.close()
    for pe in pe_types:
        results[pe].update({key: statistics.median(values) for key, values in samples[pe].items()})
        results[pe]["decode_tokens_per_s"] = 1.0 / results[pe]["decode_s_per_token"]
    return results


RATIO_KEYS = ("train_step_s", "prefill_s", "decode_tokens_per_s", "train_memory_bytes", "cache_bytes")


def ratios_to_rope(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    rope = results["rope"]
    return {pe: {key: row[key] / rope[key] for key in RATIO_KEYS} for pe, row in results.items()}


def format_table(size: SpeedSize, results: dict[str, dict]) -> str:
    """A markdown table: absolute numbers and ratios to RoPE."""
    ratios = ratios_to_rope(results)
    lines = [f"{size.name}: {size.layers} layers / hidden {size.hidden} / {size.heads} heads ({size.kv_heads} kv) / "
             f"seq {size.seq} / batch {size.batch}; decode at {size.decode_context} context",
             "",
             "| encoding | params | train step (s) | x RoPE | prefill (s) | x RoPE | decode tok/s | x RoPE | "
             "train memory (MB) | x RoPE | cache (MB) | x RoPE |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pe, row in results.items():
        r = ratios[pe]
        lines.append(
            f"| {pe} | {row['parameters'] / 1e6:.2f}M | {row['train_step_s']:.3f} | {r['train_step_s']:.2f} | "
            f"{row['prefill_s']:.3f} | {r['prefill_s']:.2f} | {row['decode_tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s']:.2f} | {row['train_memory_bytes'] / 2**20:.0f} | "
            f"{r['train_memory_bytes']:.2f} | {row['cache_bytes'] / 2**20:.1f} | {r['cache_bytes']:.2f} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Bar charts of the ratios to RoPE, one panel per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report["sizes"]
    fig, axes = plt.subplots(len(sizes), 1, figsize=(11, 3.6 * len(sizes)), squeeze=False)
    for axis, (name, entry) in zip(axes[:, 0], sizes.items()):
        ratios = entry["ratios_to_rope"]
        pes = list(ratios)
        keys = ("train_step_s", "prefill_s", "decode_tokens_per_s", "train_memory_bytes")
        labels = ("train step time", "prefill time", "decode tokens/s", "train memory")
        width = 0.8 / len(keys)
        for i, (key, label) in enumerate(zip(keys, labels)):
            axis.bar([j + i * width for j in range(len(pes))], [ratios[pe][key] for pe in pes], width, label=label)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(pes))], pes)
        axis.set_ylabel("ratio to RoPE")
        axis.set_title(f"{name}: {entry['settings']['layers']} layers, hidden {entry['settings']['hidden']}, "
                       f"seq {entry['settings']['seq']}, batch {entry['settings']['batch']}")
        axis.legend(fontsize=8, ncols=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(size_names: list[str], pe_types: list[str], out_dir: Path, progress: bool = True) -> dict:
    """Measure, print the tables, write JSON and a PNG; returns the report."""
    unknown = [pe for pe in pe_types if pe not in PE_TYPES]
    if unknown:
        raise ValueError(f"unknown encoding {unknown[0]!r}; choose from: {', '.join(PE_TYPES)}")
    if "rope" not in pe_types:
        pe_types = ["rope", *pe_types]
    report = {"environment": environment(), "sizes": {}}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"speed-{'-'.join(size_names)}"
    for name in size_names:  # results are written after every size, so a later failure loses nothing
        size = SIZES[name]
        results = measure(size, pe_types, progress)
        report["sizes"][name] = {"settings": asdict(size), "results": results,
                                 "ratios_to_rope": ratios_to_rope(results)}
        print(format_table(size, results), flush=True)
        print(flush=True)
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
        plot(report, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return report


def _bench_speed(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads} is not allowed; it must be a positive integer")
        torch.set_num_threads(args.threads)
    sizes = ["quick"] if args.quick else args.sizes
    run(sizes, args.pe or list(PE_TYPES), Path(args.out), progress=not args.no_progress)


def add_arguments(bench) -> None:
    """Register `tapelm bench speed` under `tapelm bench`."""
    speed = bench.add_parser("speed", help="training, prefill and decode speed and memory of every encoding, "
                                           "as ratios to RoPE")
    speed.add_argument("--quick", action="store_true",
                       help="one small size with short sequences (a table in about two minutes on 2 CPU cores)")
    speed.add_argument("--sizes", nargs="+", choices=["small", "large"], default=["small", "large"],
                       help="sizes to measure (default: both)")
    speed.add_argument("--pe", nargs="+", choices=PE_TYPES, metavar="PE",
                       help=f"encodings (default: all of {', '.join(PE_TYPES)}); RoPE is always included")
    speed.add_argument("--out", default="bench-results", help="folder for the JSON and PNG (default: %(default)s)")
    speed.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    speed.add_argument("--no-progress", action="store_true", help="no progress bar")
    speed.set_defaults(handler=_bench_speed)
