"""TAPE at initialisation is RoPE; RoPE is transformers' Llama; the compact state is the general L x R path;
the fused SDPA path is the explicit-softmax reference; TAPE's updates of one token at a time are the sequence's."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import DEVICE, new_model, tiny_config, tiny_model, tokens
from tapelm import TapeForCausalLM
from tapelm.fast_paths import NONE
from tapelm.positional import PositionContext
from tapelm.positional.tape import state_width

pytestmark = pytest.mark.device


def copy_shared(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Load every weight the two models share; the target may only lack TAPE's own parameters."""
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    assert not unexpected
    tape_names = {n for n, p in target.named_parameters() if any(p is q for q in target.tape_parameters())}
    assert set(missing) <= tape_names


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fresh_tape_equals_rope(kv_heads):
    rope = tiny_model("rope", num_key_value_heads=kv_heads)
    tape = new_model(tiny_config("tape", num_key_value_heads=kv_heads), seed=1)
    copy_shared(rope, tape)
    ids = tokens(2, 24)
    torch.testing.assert_close(tape(ids).logits, rope(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("pe_type", ["rope", "tape"])
def test_rope_equals_llama(kv_heads, pe_type):
    config = tiny_config(
        "rope", num_key_value_heads=kv_heads, rope_parameters={"rope_type": "default", "rope_theta": 500.0}
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        llama = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads,
                num_key_value_heads=kv_heads,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                max_position_embeddings=config.max_position_embeddings,
            )
        ).eval()
    ours = new_model(
        tiny_config(
            pe_type, num_key_value_heads=kv_heads, rope_parameters={"rope_type": "default", "rope_theta": 500.0}
        )
    )
    copy_shared(llama, ours)
    ids = tokens(2, 40)
    torch.testing.assert_close(ours(ids).logits, llama(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 32},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "rope_theta": 1e4,
            "original_max_position_embeddings": 32,
        },
    ],
)
def test_fresh_tape_equals_rope_under_scalings(rope_parameters):
    rope = tiny_model("rope", rope_parameters=dict(rope_parameters))
    tape = new_model(tiny_config("tape", rope_parameters=dict(rope_parameters)))
    copy_shared(rope, tape)
    ids = tokens(1, 48)
    torch.testing.assert_close(tape(ids).logits, rope(ids).logits, atol=1e-5, rtol=0)


def use_general_path(model: TapeForCausalLM) -> TapeForCausalLM:
    """Switch a compact-state model to the general L x R representation (same parameters)."""
    model.model.positional.compact = False
    for layer in model.model.layers:
        layer.positional.compact = False
    return model


@pytest.mark.parametrize("mixing", ["heads", "per_head"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_compact_state_equals_general_path(mixing, kv_heads):
    compact = tiny_model(
        "tape", dtype=torch.float64, num_hidden_layers=3, num_key_value_heads=kv_heads, tape_attn_mixing=mixing
    )
    general = use_general_path(
        tiny_model(
            "tape", dtype=torch.float64, num_hidden_layers=3, num_key_value_heads=kv_heads, tape_attn_mixing=mixing
        )
    )
    ids = tokens(2, 20)
    expected = general(ids).logits
    assert not torch.allclose(
        expected,
        use_general_path(tiny_model("rope", dtype=torch.float64, num_hidden_layers=3, num_key_value_heads=kv_heads))(
            ids
        ).logits,
    )
    torch.testing.assert_close(compact(ids).logits, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 4},
        {"tape_block": (2, 4)},
        {"tape_block": (4, 4)},
        {"tape_equivariant": False},
        {"tape_attn_mixing": "per_head"},
        {"tape_update": "attention"},
        {"tape_update": "mlp"},
    ],
)
def test_sdpa_equals_eager_reference_for_tape(overrides):
    ids = tokens(2, 24)
    sdpa = tiny_model("tape", dtype=torch.float64, **overrides)
    eager = tiny_model("tape", dtype=torch.float64, **overrides)
    eager.config._attn_implementation = "eager"
    torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, atol=1e-10, rtol=0)


def test_sdpa_equals_eager_reference(pe_type):
    ids = tokens(2, 24)
    sdpa, eager = tiny_model(pe_type, dtype=torch.float64), tiny_model(pe_type, dtype=torch.float64)
    eager.config._attn_implementation = "eager"
    torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, atol=1e-10, rtol=0)


def test_gradients_flow_through_the_fused_stream():
    """The fused [V | E] call keeps the gradient that reaches q and k through the E outputs."""
    ids = tokens(2, 16)
    grads = {}
    for impl in ("sdpa", "eager"):
        model = tiny_model("tape", dtype=torch.float64)
        model.config._attn_implementation = impl
        model(ids, labels=ids).loss.backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["eager"].items():
        torch.testing.assert_close(grads["sdpa"][name], grad, atol=1e-9, rtol=1e-7, msg=name)
    assert grads["sdpa"]["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_tape_updating_no_layer_is_rope_even_with_random_weights():
    rope = tiny_model("rope", num_hidden_layers=3)
    frozen = tiny_model("tape", num_hidden_layers=3, tape_layers="none", seed=5)
    assert list(frozen.tape_parameters()) == []
    copy_shared(rope, frozen)
    ids = tokens(2, 20)
    torch.testing.assert_close(frozen(ids).logits, rope(ids).logits, atol=1e-5, rtol=0)


def randomize_tape_parameters(model: TapeForCausalLM) -> None:
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for param in model.tape_parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator, device="cpu").to(DEVICE))


@pytest.mark.parametrize(
    ("choice", "updating"), [("first_half", [0, 1]), ("second_half", [2, 3]), ([1], [1]), ("all", [0, 1, 2, 3])]
)
def test_tape_layers_chooses_which_layers_update(choice, updating):
    """Only the chosen layers carry update parameters (never the last), and layers before the first one see E0:
    a model whose first updating layer is k computes, up to layer k, what RoPE computes."""
    model = tiny_model("tape", num_hidden_layers=5, tape_layers=choice)
    with_params = [i for i, layer in enumerate(model.model.layers) if list(layer.positional.parameters())]
    assert with_params == [i for i in updating if i < 4]
    rope = tiny_model("rope", num_hidden_layers=5)
    copy_shared(rope, model)
    randomize_tape_parameters(model)
    ids = tokens(1, 12)
    ours = model(ids, output_hidden_states=True).hidden_states
    theirs = rope(ids, output_hidden_states=True).hidden_states
    first = min(updating)
    for layer in range(first + 2):  # inputs of layers 0..first+1: layer `first` updates E only after its attention
        torch.testing.assert_close(ours[layer], theirs[layer], atol=1e-5, rtol=0)
    assert not torch.allclose(ours[first + 2], theirs[first + 2], atol=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 4},
        {"tape_attn_mixing": "per_head"},
        {"tape_equivariant": False},
        {"tape_block": (2, 4)},
    ],
)
def test_tape_updates_of_one_token_at_a_time_equal_the_sequences(overrides):
    """A decoding step's state updates (one token: the branches with the fewest calls) compute, token by token, what
    the sequence's compute: the updated state and the gradients of the state, the inputs and every parameter, in
    float64."""
    model = tiny_model("tape", dtype=torch.float64, **overrides)
    layer, config, length = model.model.layers[0].positional, model.config, 5
    generator = torch.Generator().manual_seed(0)
    shapes = (
        (2, config.num_key_value_heads, length, state_width(config)),
        (2, config.num_attention_heads, length, state_width(config)),
        (2, length, config.hidden_size),
    )
    state, attended, mlp_out = (
        torch.randn(*shape, dtype=torch.float64, generator=generator, device="cpu").to(DEVICE).requires_grad_()
        for shape in shapes
    )
    inputs = (state, attended, mlp_out, *layer.parameters())

    def update(tokens: slice) -> torch.Tensor:
        positions = torch.zeros(2, tokens.stop - tokens.start, dtype=torch.long, device=DEVICE)
        ctx = PositionContext(paths=NONE, query_positions=positions)
        middle = layer.after_attention(state[:, :, tokens], attended[:, :, tokens], ctx)
        return layer.after_mlp(middle, mlp_out[:, tokens], ctx)

    whole = update(slice(0, length))
    grads = torch.autograd.grad(whole.square().sum(), inputs)
    singles = torch.cat([update(slice(n, n + 1)) for n in range(length)], dim=2)
    torch.testing.assert_close(singles, whole, atol=1e-12, rtol=0)
    for actual, expected in zip(torch.autograd.grad(singles.square().sum(), inputs), grads):
        torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)
