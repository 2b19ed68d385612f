"""The symmetry laws of shared/TAPE.md §3, in float64 with random non-zero TAPE weights over several layers."""

import functools

import pytest
import torch

from conftest import DEVICE, tiny_model, tokens
from tapelm.fast_paths import NONE
from tapelm.positional import PositionContext
from test_equivalence import use_general_path

pytestmark = pytest.mark.device

LAYERS = 3


@functools.cache
def shared_model(pe_type: str, **overrides):
    """A float64 model reused across hypothesis examples (tests must not modify it)."""
    return tiny_model(pe_type, dtype=torch.float64, num_hidden_layers=LAYERS, **overrides)


def run_with_states(model, ids, position_ids=None, transform_initial=None):
    """Logits and the positional state leaving every layer (the last layer's is returned unchanged)."""
    states = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: states.append(out[1])) for layer in model.model.layers]
    encoding = model.model.positional
    original = encoding.initial_state
    if transform_initial is not None:
        encoding.initial_state = lambda ctx, dtype: transform_initial(original(ctx, dtype))
    try:
        logits = model(ids, position_ids=position_ids).logits
    finally:
        encoding.initial_state = original
        for hook in hooks:
            hook.remove()
    return logits, states


def random_orthogonal(blocks: int, size: int, seed: int) -> torch.Tensor:
    """One O(size) matrix per block, reflections included."""
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(blocks, size, size, generator=generator, dtype=torch.float64, device="cpu"))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]
    q[0, :, 0] *= -1  # make sure the first block is a reflection
    return q.to(DEVICE)


def right_multiply(state: torch.Tensor, q: torch.Tensor, block_l: int, block_r: int) -> torch.Tensor:
    blocks = q.shape[0]
    e = state.unflatten(-1, (blocks, block_l, block_r))
    return (e @ q).flatten(-3)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tape_block=(2, 2)),
        dict(tape_block=(2, 4)),
        dict(tape_block=(4, 4)),
        dict(tape_block=(2, 2), num_key_value_heads=4, tape_attn_mixing="per_head"),
    ],
)
def test_orthogonal_invariance_and_equivariance(overrides):
    """E -> EQ leaves token outputs unchanged and every layer's E update maps to (update) Q."""
    model = use_general_path(tiny_model("tape", dtype=torch.float64, num_hidden_layers=LAYERS, **overrides))
    block_l, block_r = model.config.tape_block
    q = random_orthogonal(model.config.head_dim // block_l, block_r, seed=3)
    ids = tokens(2, 20)
    logits, states = run_with_states(model, ids)
    logits_q, states_q = run_with_states(model, ids, transform_initial=lambda e: right_multiply(e, q, block_l, block_r))
    torch.testing.assert_close(logits_q, logits, atol=1e-10, rtol=0)
    for state, state_q in zip(states[:-1], states_q[:-1]):
        torch.testing.assert_close(state_q, right_multiply(state, q, block_l, block_r), atol=1e-10, rtol=0)
    assert not torch.allclose(states[0], states[-1])  # the updates did act


def test_rotation_invariance_of_compact_state():
    """The compact state represents each block as a scaled rotation; a rotation Q keeps that form."""
    model = tiny_model("tape", dtype=torch.float64, num_hidden_layers=LAYERS)
    half = model.config.head_dim // 2
    angle = torch.linspace(0.3, 2.9, half, dtype=torch.float64, device=DEVICE)

    def rotate_state(e):
        re, im = e[..., :half], e[..., half:]
        # [[a, b], [-b, a]] @ Rot(phi) is again of that form
        return torch.cat([re * angle.cos() + im * angle.sin(), im * angle.cos() - re * angle.sin()], dim=-1)

    ids = tokens(2, 20)
    logits, _ = run_with_states(model, ids)
    logits_q, _ = run_with_states(model, ids, transform_initial=rotate_state)
    torch.testing.assert_close(logits_q, logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "pe_type, overrides",
    [
        ("tape", {}),
        ("tape", dict(tape_block=(2, 4))),
        ("tape", dict(tape_equivariant=False)),
        ("rope", {}),
        ("alibi", {}),
        ("t5", {}),
        ("fire", {}),
        ("xpos", {}),
        ("learned", {}),
        ("sinusoidal", {}),
        ("nope", {}),
    ],
)
def test_permutation_equivariance_in_encoder_mode(pe_type, overrides):
    """Permuting tokens together with their positions permutes the outputs (bidirectional attention)."""
    model = tiny_model(pe_type, dtype=torch.float64, num_hidden_layers=LAYERS, causal=False, **overrides)
    ids = tokens(2, 16)
    positions = torch.arange(16, device=DEVICE).expand(2, -1)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(5), device="cpu").to(DEVICE)
    logits = model(ids, position_ids=positions).logits
    logits_p = model(ids[:, perm], position_ids=positions[:, perm]).logits
    torch.testing.assert_close(logits_p, logits[:, perm], atol=1e-10, rtol=0)


@pytest.mark.parametrize("block", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_initial_state_is_relative(block):
    """E0_i E0_j^T depends only on j - i, and with R = L it is RoPE's rotation by (j - i) theta."""
    model = tiny_model("tape", tape_block=block, head_dim=16, hidden_size=64)
    encoding = use_general_path(model).model.positional
    ctx = PositionContext(paths=NONE, query_positions=torch.arange(40, device=DEVICE)[None])
    encoding.prepare(ctx, torch.float32)
    blocks = 16 // block[0]
    e = ctx.tables["e0"][0].double().unflatten(-1, (blocks, *block))  # (N, M, L, R)
    gram = torch.einsum("imlr,jmkr->mijlk", e, e)  # per block: E_i E_j^T
    torch.testing.assert_close(gram[:, 5:30, 7:32], gram[:, 0:25, 2:27], atol=2e-5, rtol=0)
    torch.testing.assert_close(
        gram[:, 10, 10],
        torch.eye(block[0], dtype=torch.float64, device=DEVICE).expand(blocks, -1, -1),
        atol=1e-6,
        rtol=0,
    )
