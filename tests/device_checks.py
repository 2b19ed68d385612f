"""CPU-side guards for device mistakes (CI has no GPU).

`FactoryWatch` flags every tensor factory (arange, ones, zeros, full, tensor, ...) that tapelm's own code calls
without a device: on a GPU such a tensor lands on the CPU, where it either crashes ("Expected all tensors to be on the
same device") or costs a host-to-device copy in every forward pass. `OwnCodeElsewhere` puts what tapelm's code and the
tests make without a device on the meta device instead (conftest.py: the law tests on the CPU). `InputWatch`
checks, at every top-level model
call, that the model sits on the device of its process and that every tensor it is given sits there too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import tapelm

SOURCE = Path(tapelm.__file__).resolve().parent
HERE = Path(__file__).resolve()
TESTS = HERE.parent
FACTORIES = {
    torch.arange,
    torch.ones,
    torch.zeros,
    torch.full,
    torch.empty,
    torch.tensor,
    torch.as_tensor,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.linspace,
    torch.logspace,
    torch.empty_strided,
    torch.scalar_tensor,
    torch.tril_indices,
    torch.triu_indices,
    torch.normal,
}


def _caller_in(*roots: Path) -> str | None:
    """'file:line' of the first frame outside torch and this module on the stack when its file lies under one of
    `roots`, else None."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path == HERE or "torch" in path.parts:
            frame = frame.f_back
            continue
        root = next((root for root in roots if path.is_relative_to(root)), None)
        return None if root is None else f"{path.relative_to(root.parent)}:{frame.f_lineno}"
    return None


def _without_device(func, args, kwargs) -> bool:
    """A factory call that takes the default device (as_tensor of a tensor keeps the tensor's)."""
    return (
        func in FACTORIES
        and kwargs.get("device") is None
        and not (func is torch.as_tensor and args and isinstance(args[0], torch.Tensor))
    )


class FactoryWatch(TorchFunctionMode):
    """Records 'function at file:line' for each factory tapelm calls without a device while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _without_device(func, args, kwargs):
            where = _caller_in(SOURCE)
            if where is not None:
                self.calls.append(f"torch.{func.__name__} at {where}")
        return func(*args, **kwargs)


class OwnCodeElsewhere(TorchFunctionMode):
    """Tensors that tapelm's code or a test makes without a device are made on the meta device (other libraries'
    are left alone: transformers' beam search, for one, makes CPU tensors and moves them)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _without_device(func, args, kwargs) and _caller_in(SOURCE, TESTS) is not None:
            kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


class ModelReached(BaseException):
    """Raised by `InputWatch` after it checked the first model call: a model on the meta device computes nothing
    further. A BaseException, so that commands which carry on after a failing part (`except Exception`) stop."""


class InputWatch:
    """Installed with `install(monkeypatch)`: the first call of a transformers model, or of its `generate` (which
    cannot run on the meta device), records the devices of the model and of every tensor passed to it, then raises
    `ModelReached`."""

    def __init__(self):
        self.seen: list[dict] = []

    def install(self, monkeypatch) -> InputWatch:
        from transformers import GenerationMixin, PreTrainedModel

        original = torch.nn.Module.__call__
        watch = self

        def check(model, args, kwargs, what: str):
            if not watch.seen:
                tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
                watch.seen.append(
                    {
                        "model": model.device,
                        "inputs": [t.device for t in tensors],
                        "model_class": f"{type(model).__name__}{what}",
                    }
                )
                raise ModelReached()

        def call(module, *args, **kwargs):
            check(module, args, kwargs, "")
            return original(module, *args, **kwargs)

        def generate(model, *args, **kwargs):
            check(model, args, kwargs, ".generate")

        monkeypatch.setattr(PreTrainedModel, "__call__", call, raising=False)
        monkeypatch.setattr(GenerationMixin, "generate", generate)
        return self

    def assert_on(self, device: torch.device) -> None:
        """The model was reached, on `device`, with every input tensor there."""
        assert self.seen, "no model was called"
        seen = self.seen[0]
        assert seen["model"] == device, f"{seen['model_class']} runs on {seen['model']}, not on {device}"
        assert seen["inputs"] and all(d == device for d in seen["inputs"]), (
            f"{seen['model_class']} on {device} got inputs on {seen['inputs']}"
        )
