"""The public encoding API: an encoding registered from outside tapelm (by `register_encoding` or an installed
package's entry point) is a `pe_type` like a built-in, in configs, layer schedules, saved folders and the lab's rows;
a saved model whose encoding's package is missing fails to load naming it; bad registrations are refused in one
line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_model, tokens
from tapelm import TapeConfig, encoding_names, register_encoding
from tapelm.positional import StepCost, encoding_class, registry, unregister_encoding
from tapelm.positional.rotary import RoPE
from tapelm.testing import registered_for_test
from tapelm.variants import check_row, display_name


class Shifted(RoPE):
    """RoPE whose rotation starts `shifted_by` positions later: an encoding with a config field of its own."""

    display_name = "Shifted RoPE"
    config_fields = {"shifted_by": 3}

    @classmethod
    def validate_fields(cls, config) -> None:
        if not isinstance(config.shifted_by, int) or config.shifted_by < 0:
            raise ValueError(f"shifted_by={config.shifted_by!r} is not allowed; it must be a non-negative integer")

    def __init__(self, config):
        super().__init__(config)
        self.shift = config.shifted_by

    def positions(self, position_ids, past=0, documents=None, extent=None):
        return position_ids + self.shift


def test_a_registered_encoding_is_a_pe_type_with_its_own_fields_and_name():
    with registered_for_test("shifted", Shifted):
        assert "shifted" in encoding_names() and encoding_class("shifted") is Shifted
        config = TapeConfig(pe_type="shifted")
        assert config.shifted_by == 3 and TapeConfig(pe_type="rope").shifted_by == 3  # every config carries them
        assert TapeConfig(pe_type="shifted", shifted_by=5).shifted_by == 5
        with pytest.raises(ValueError, match="shifted_by=-1 is not allowed; it must be a non-negative integer"):
            TapeConfig(pe_type="shifted", shifted_by=-1)
        check_row("shifted")  # a row of compare, sweep and bench
        assert display_name("shifted") == "Shifted RoPE"
    assert "shifted" not in encoding_names()
    with pytest.raises(ValueError, match="unknown encoding 'shifted'"):
        check_row("shifted")


def test_a_registered_encoding_joins_a_layer_schedule_and_computes_what_it_computes_alone():
    with registered_for_test("shifted", Shifted):
        alone = tiny_model("shifted", dtype=torch.float64)
        mixed = tiny_model("rope", dtype=torch.float64, layer_pe_types=["shifted", "shifted"])
        state = {
            key.replace("positional.", "positional.encodings.shifted."): v for key, v in alone.state_dict().items()
        }
        mixed.load_state_dict(state)
        ids = tokens(2, 9)
        torch.testing.assert_close(mixed(ids).logits, alone(ids).logits, atol=1e-12, rtol=0)


def test_a_saved_model_of_a_packaged_encoding_loads_where_the_package_is_and_names_it_where_it_is_not(tmp_path):
    register_encoding("shifted", Shifted, package="tapelm-shifted")
    try:
        model = tiny_model("shifted", shifted_by=2)
        model.save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        assert saved["encoding_packages"] == {"shifted": "tapelm-shifted"} and saved["shifted_by"] == 2
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        ids = tokens(2, 7)
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    finally:
        unregister_encoding("shifted")
    with pytest.raises(ValueError) as refused:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (
        "pe_type='shifted' is not registered: it comes from the package 'tapelm-shifted', which is not installed "
        "here (pip install tapelm-shifted)" in str(refused.value)
    )


def test_an_installed_packages_entry_point_registers_its_encoding(tmp_path, monkeypatch):
    """A distribution on sys.path that declares `tapelm.encodings` entry points, as `pip install` leaves one."""
    package = tmp_path / "tapelm_shifted_plugin"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from tapelm.positional.rotary import RoPE\n\nclass Late(RoPE):\n    display_name = 'Late RoPE'\n"
    )
    info = tmp_path / "tapelm_shifted_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tapelm-shifted-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tapelm.encodings]\nlate-rope = tapelm_shifted_plugin:Late\n")
    (info / "top_level.txt").write_text("tapelm_shifted_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_read", False)
    try:
        assert encoding_class("late-rope").__name__ == "Late"
        assert registry.package_of("late-rope") == "tapelm-shifted-plugin"
        assert TapeConfig(pe_type="late-rope").encoding_packages == {"late-rope": "tapelm-shifted-plugin"}
    finally:
        unregister_encoding("late-rope")


def test_a_package_whose_encoding_cannot_be_imported_is_named(tmp_path, monkeypatch):
    info = tmp_path / "broken_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tapelm.encodings]\nbroken = no_such_module:Encoding\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_read", False)
    with pytest.raises(ValueError, match="the encoding 'broken' that package 'broken-plugin' declares .* cannot be"):
        encoding_class("broken")
    monkeypatch.setattr(registry, "_entry_points_read", True)


class NotAnEncoding:
    pass


class BadFamily(RoPE):
    family = "oscillating"


class BadCost(RoPE):
    step_cost = 1.5


class BadLimit(RoPE):
    reads_position_limit = "no"


@pytest.mark.parametrize(
    ("name", "cls", "message"),
    [
        ("Kerple", RoPE, "encoding name 'Kerple' is not allowed; use lower case letters and digits"),
        ("my encoding", RoPE, "encoding name 'my encoding' is not allowed"),
        ("mine", NotAnEncoding, "is not a subclass of tapelm.positional.PositionalEncoding"),
        ("mine", BadFamily, "mine: family='oscillating' is not allowed; choose one of: None, accumulating, decaying"),
        ("mine", BadCost, "mine: step_cost=1.5 is not allowed; give a StepCost or None"),
        ("mine", BadLimit, "mine: reads_position_limit='no' is not allowed"),
        ("rope", Shifted, "encoding 'rope' is already registered as tapelm.positional.rotary.RoPE"),
    ],
)
def test_a_bad_registration_is_refused_in_one_line(name, cls, message):
    with pytest.raises(ValueError, match=message):
        register_encoding(name, cls)
    assert encoding_class("rope") is RoPE and "mine" not in encoding_names()


def test_registering_the_same_class_again_changes_nothing():
    register_encoding("rope", RoPE)
    assert encoding_names().count("rope") == 1


def test_every_built_in_declares_its_facts():
    """Each of tapelm's own has a display name of its own but the absolute ones the report names by pe_type, and a
    step cost with its source unless no measurement or estimate exists (sinusoidal, learned)."""
    from tapelm.positional import BUILT_IN

    for name, cls in BUILT_IN.items():
        assert vars(cls).get("display_name") or name in ("sinusoidal", "learned"), name
        cost = cls.step_cost
        assert (cost is None) == (name in ("sinusoidal", "learned")), name
        assert cost is None or (isinstance(cost, StepCost) and cost.ratio > 0 and cost.source), name


def test_an_encoding_reads_the_position_limit_unless_it_says_otherwise():
    """The safe default: a run of an encoding that declares nothing is keyed on the position limits its evaluation
    sizes (`runs.training_identity`); tapelm's own say which they read, and the kit holds them to it."""
    from tapelm.positional.base import PositionalEncoding

    assert PositionalEncoding.reads_position_limit
    reading = {name for name in encoding_names() if encoding_class(name).reads_position_limit}
    assert reading == {"learned", "randpe", "xpos"}
