"""KERPLE (log) held to tapelm's laws, and to its paper's formula."""

from __future__ import annotations

import pytest
import torch

from tapelm.positional import encoding_class
from tapelm.testing import LAWS, Subject

SUBJECT = Subject("kerple-log")


def test_the_entry_point_registers_it():
    from tapelm_kerple import KerpleLog

    assert encoding_class("kerple-log") is KerpleLog


@pytest.mark.parametrize("law", [law for law in LAWS if law != "compiles"])
def test_kerple_obeys_every_law(law):
    LAWS[law](SUBJECT)


def test_the_bias_is_the_papers_kernel():
    """bias_h(i, j) = -p_h log(1 + a_h (i - j)) for j <= i, from the layer's own parameters."""
    model = SUBJECT.model()
    layer = model.model.layers[0].positional
    positions = torch.arange(6, dtype=torch.float64)
    with torch.no_grad():
        layer.p.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0]))
        layer.a.copy_(torch.tensor([0.005, 0.25, 0.5, 1.0]))  # the first below eps: 0.01 is used
    ctx = type("Context", (), {"query_positions": positions[None], "key_positions": positions[None]})
    q = torch.zeros(1, 4, 6, 8, dtype=torch.float64)
    bias = layer.logit_bias(q, q, None, ctx)[0]
    p = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
    a = torch.tensor([0.01, 0.25, 0.5, 1.0], dtype=torch.float64)
    for i in range(6):
        for j in range(i + 1):
            torch.testing.assert_close(bias[:, i, j], -p * torch.log(1 + a * (i - j)), rtol=0, atol=1e-12)
