"""Options of the attention that hold for any positional encoding: how the logits grow with the number of keys a
query sees, and a gate on the attention's output.

- SSMax (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399; `ssmax`): each softmax row
  is softmax(s_h log(n) z) over the logits z of the n keys the query sees, with one learned s per head and layer,
  starting at `ssmax_scale_init` (0.43, the value of the paper's
  Figure 1). Without it, the largest weight of a softmax over n keys
  falls towards 0 as n grows ("attention fading").
- The output gate (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708, as Qwen3-Next
  uses it; `attention_gate`): the attention output of each head is multiplied by sigmoid(x W_g) before the output
  projection, x the layer's attention input (after the norm): "elementwise" (one gate per output feature, the
  paper's best variant, Qwen3-Next's) or "headwise" (one per head).

Both act on the token stream only: a positional state that rides on the value stream (TAPE's) is attended as
before and left ungated, so the encoding computes what it defines.
"""

from __future__ import annotations

import torch
from torch import nn

from .positional.base import CustomInit, check_bool, check_choice, check_positive_number

ATTENTION_GATES = (None, "headwise", "elementwise")


def check_attention_options(config, encodings: dict) -> None:
    """Raise ValueError naming a bad `ssmax`, `ssmax_scale_init` or `attention_gate`, or SSMax on a layer whose
    encoding computes its attention itself (no softmax of logits to scale). `encodings`: name -> class of the
    layers' encodings."""
    check_bool("ssmax", config.ssmax)
    check_positive_number("ssmax_scale_init", config.ssmax_scale_init)
    check_choice("attention_gate", config.attention_gate, ATTENTION_GATES)
    if config.ssmax:
        own = [name for name, encoding in encodings.items() if not encoding.softmax_of_logits]
        if own:
            raise ValueError(
                f"ssmax=True scales the logits of a softmax, but pe_type={own[0]!r} computes its attention itself; "
                "use it with an encoding whose attention is a softmax of logits"
            )


class ScalableSoftmax(CustomInit):
    """SSMax's factor on each query's logits: s_h log(n), n the keys it sees, one learned s per head."""

    def __init__(self, config):
        super().__init__()
        self.scale = nn.Parameter(torch.full((config.num_attention_heads,), float(config.ssmax_scale_init)))
        self.scale_init = config.ssmax_scale_init

    def init_weights(self, init, std: float) -> None:
        init.constant_(self.scale, self.scale_init)

    def forward(self, keys_seen: torch.Tensor) -> torch.Tensor:
        """(B or 1, 1, N, 1) counts -> (B or 1, H, N, 1) factors, in float32 at least."""
        scale = self.scale.to(torch.promote_types(self.scale.dtype, torch.float32))
        return scale[:, None, None] * keys_seen.to(scale.dtype).log()


class OutputGate(nn.Module):
    """sigmoid(x W_g), multiplying the heads' outputs: one gate per feature ("elementwise") or per head."""

    def __init__(self, config):
        super().__init__()
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        width = self.heads * (self.head_dim if config.attention_gate == "elementwise" else 1)
        self.proj = nn.Linear(config.hidden_size, width, bias=False)

    def forward(self, x: torch.Tensor, heads_out: torch.Tensor) -> torch.Tensor:
        """`heads_out` (..., H x head_dim) gated by the attention input `x` (..., hidden_size) of the same tokens."""
        gate = torch.sigmoid(self.proj(x))
        if gate.shape[-1] == heads_out.shape[-1]:
            return heads_out * gate
        return (heads_out.unflatten(-1, (self.heads, self.head_dim)) * gate[..., None]).flatten(-2)


__all__ = ["ATTENTION_GATES", "OutputGate", "ScalableSoftmax", "check_attention_options"]
