"""Evaluating a pretrained or retrofitted causal LM with its own tokenizer: perplexity against context length with
sliding windows, passkey retrieval against length, and a greedy generation sample.

Perplexity. For every context length L the same held-out tokens are scored: in each long held-out document, the
`scored` tokens that follow its first max(lengths) tokens. Windows of L tokens move by the stride (the paper's 256,
or L/2 when L <= 256) and score only their last `stride` tokens, so every scored token sees between L - stride and L
tokens of context from its own document. Only the logits that are scored are computed (`logits_to_keep`).

Passkey (shared/TAPE.md §7) with the model's tokenizer: task line, filler, the key line at a random depth, the
question; as many whole filler sentences as fit in L tokens. A trial is correct when greedy decoding continues the
prompt with " K" followed by a non-digit; this is checked with one teacher-forced forward pass (argmax at every
answer position), which is exactly what greedy decoding would produce.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ..data.passkey_text import (
    FILLER,
    KEY_HIGH,
    KEY_LOW,
    TASK_LINE,
    key_line,
    question,
)
from ..training.devices import model_device

PAPER_STRIDE = 256


def stride_for(length: int) -> int:
    return min(PAPER_STRIDE, length // 2)


@torch.no_grad()
def perplexity(model, documents: list[np.ndarray], length: int, context_from: int, scored: int) -> dict:
    """Perplexity of tokens [context_from, context_from + scored) of every document with windows of `length`."""
    stride = stride_for(length)
    if scored % stride:
        raise ValueError(f"scored={scored} must be a multiple of the stride {stride} (length {length})")
    if context_from < length:
        raise ValueError(f"context_from={context_from} must be at least the window length {length}")
    total, count, windows = 0.0, 0, 0
    device = model_device(model)
    for ids in documents:
        if len(ids) < context_from + scored:
            raise ValueError(f"a document has {len(ids)} tokens, fewer than {context_from + scored}")
        for end in range(context_from + stride, context_from + scored + 1, stride):
            window = torch.from_numpy(ids[end - length : end])[None].to(device)
            logits = model(input_ids=window, use_cache=False, logits_to_keep=stride + 1).logits[0, :-1].float()
            targets = window[0, -stride:]
            total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            count += stride
            windows += 1
    return {"perplexity": math.exp(total / count), "tokens": count, "windows": windows, "stride": stride}


def passkey_prompt(tokenizer, length: int, key: int, depth: float) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids for " K") of a passkey document of at most `length` tokens."""
    answer = tokenizer(f" {key}", add_special_tokens=False)["input_ids"]
    needle, query = key_line(key, None), question(None)

    def build(sentences: int) -> list[int]:
        filler = [FILLER[i % len(FILLER)] for i in range(sentences)]
        slot = round(depth * sentences)
        text = " ".join([TASK_LINE, *filler[:slot], needle, *filler[slot:], query])
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    low, high = 0, 1
    while len(build(high)) + len(answer) + 1 <= length:
        low, high = high, high * 2
    while high - low > 1:  # largest sentence count that fits (token count grows with sentences)
        middle = (low + high) // 2
        if len(build(middle)) + len(answer) + 1 <= length:
            low = middle
        else:
            high = middle
    prompt = build(low)
    if len(prompt) + len(answer) + 1 > length:
        raise ValueError(f"a passkey document does not fit in {length} tokens")
    return prompt, answer


def _digit_ids(tokenizer) -> set[int]:
    ids = set()
    for digit in "0123456789":
        for text in (digit, f" {digit}"):
            ids.update(tokenizer(text, add_special_tokens=False)["input_ids"][-1:])
    return ids


@torch.no_grad()
def passkey(model, tokenizer, length: int, trials: int = 20, seed: int = 0) -> dict:
    """Accuracy of greedy passkey retrieval in documents of `length` tokens (keys and depths seeded)."""
    rng = np.random.default_rng([seed, length])
    digits = _digit_ids(tokenizer)
    correct, tokens, device = 0, [], model_device(model)
    for _ in range(trials):
        key, depth = int(rng.integers(KEY_LOW, KEY_HIGH)), float(rng.random())
        prompt, answer = passkey_prompt(tokenizer, length, key, depth)
        ids = torch.tensor([prompt + answer], device=device)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(answer) + 1).logits[0]
        predicted = logits.argmax(-1).tolist()
        correct += int(predicted[:-1] == answer and predicted[-1] not in digits)
        tokens.append(ids.shape[1])
    return {"accuracy": correct / trials, "trials": trials, "mean_tokens": float(np.mean(tokens))}


@torch.no_grad()
def generation_sample(model, tokenizer, prompt: str, max_new_tokens: int = 40) -> str:
    """The greedy continuation of `prompt`."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=model_device(model))
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def evaluate_model(
    model,
    tokenizer,
    documents: dict[str, list[np.ndarray]],
    lengths: list[int],
    passkey_lengths: list[int],
    scored: int,
    trials: int = 20,
    seed: int = 0,
    sample_prompt: str | None = None,
    log=print,
) -> dict:
    """Perplexity per corpus and length, passkey accuracy per length and a generation sample, as a JSON-able dict."""
    model.eval()
    context_from = max(lengths)
    result: dict = {"perplexity": {}, "passkey": {}, "seconds": {}}
    for corpus, docs in documents.items():
        result["perplexity"][corpus] = {}
        for length in lengths:
            started = time.perf_counter()
            value = perplexity(model, docs, length, context_from, scored)
            result["perplexity"][corpus][str(length)] = value
            result["seconds"][f"ppl-{corpus}-{length}"] = time.perf_counter() - started
            log(f"  perplexity {corpus} L={length}: {value['perplexity']:.3f}")
    for length in passkey_lengths:
        started = time.perf_counter()
        value = passkey(model, tokenizer, length, trials, seed)
        result["passkey"][str(length)] = value
        result["seconds"][f"passkey-{length}"] = time.perf_counter() - started
        log(f"  passkey L={length}: {value['accuracy']:.2f}")
    if sample_prompt is not None:
        result["sample"] = {"prompt": sample_prompt, "continuation": generation_sample(model, tokenizer, sample_prompt)}
    return result
