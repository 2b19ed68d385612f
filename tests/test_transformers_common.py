"""transformers' own `ModelTesterMixin` (and `GenerationTesterMixin` where the source tree has it) run against
`TapeForCausalLM` for every pe_type, and against Llama through the same tester as the baseline.

The mixins come from the installed transformers' source release (`tests/transformers_sources.py`); without it the
module is skipped with the reason. The model tester mirrors what transformers' causal-LM testers build for Llama:
batch 13, 7 tokens, right-padded rows (`tril` attention mask), a 2-layer model of width 32.
"""

from __future__ import annotations

import os
import re
import unittest
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

from tapelm import PE_TYPES, TapeConfig, TapeForCausalLM, TapeModel
from transformers_sources import load_mixins, source_dir

ROOT = source_dir()
if ROOT is None:
    pytest.skip(
        "transformers' test sources are absent: run `python tests/transformers_sources.py fetch` "
        "(or set TAPELM_TRANSFORMERS_SRC to a transformers checkout)",
        allow_module_level=True,
    )
common = load_mixins(ROOT)
pytestmark = pytest.mark.transformers_common

# CI's budget: every test for TAPE, RoPE and Llama; for the other encodings the tests that exercise the forward pass,
# its outputs, masks, training and serialisation (TAPELM_TRANSFORMERS_COMMON=full runs everything for every pe_type).
FULL = os.environ.get("TAPELM_TRANSFORMERS_COMMON") == "full"
FULL_SUITES = ("tape", "rope", "llama")
SUBSET = re.compile(
    r"test_(attention_outputs|hidden_states_output|batching_equivalence|model_outputs_equivalence|"
    r"eager_matches_sdpa_inference_\d+_fp32_pad_left$|save_load$|training$|retain_grad|determinism|"
    r"left_padding|inputs_embeds|model_main_input_name|forward_signature|resize_tokens_embeddings$|"
    r"generation_tester_mixin_inheritance|can_set_attention_dynamically$)"
)


class CausalModelTester:
    """What the mixins ask of a model tester, for one config class and its model classes."""

    batch_size, seq_length, vocab_size = 13, 7, 99
    hidden_size, num_hidden_layers, num_attention_heads = 32, 2, 4
    is_training = True

    def __init__(self, parent, make_config):
        self.parent = parent
        self.make_config = make_config

    def get_config(self):
        return self.make_config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=2,
            intermediate_size=37,
            hidden_act="silu",
            max_position_embeddings=512,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


def _tape_config(pe_type: str, **options):
    def make(**sizes):
        # RandPE on the given positions: its default random draw per forward pass is nondeterministic by design.
        return TapeConfig(
            pe_type=pe_type,
            fire_hidden_size=8,
            cope_max_positions=16,
            randpe_eval_positions="given",
            **options,
            **sizes,
        )

    return make


def outside_ci_subset(item: pytest.Item) -> bool:
    """Whether CI's budget leaves this test out (conftest deselects it before anything runs; the environment variable
    TAPELM_TRANSFORMERS_COMMON=full runs it)."""
    suite = item.cls.__name__.removeprefix("TestCommon_")
    return not FULL and suite not in FULL_SUITES and not SUBSET.match(item.name)


def _suite(name: str, make_config, model_classes) -> type:
    bases = (common.ModelTesterMixin, common.GenerationTesterMixin, unittest.TestCase)

    def setUp(self):
        self.model_tester = CausalModelTester(self, make_config)
        # The mixins tell a base model from a causal LM by transformers' in-tree name tables; an in-tree "tape" would
        # be listed there, so it is for the length of each test.
        for table, entry in (
            (MODEL_MAPPING_NAMES, "TapeModel"),
            (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "TapeForCausalLM"),
        ):
            patcher = mock.patch.dict(table, {"tape": entry})
            patcher.start()
            self.addCleanup(patcher.stop)

    return type(name, bases, {"all_model_classes": model_classes, "setUp": setUp, "__module__": __name__})


for _pe_type in PE_TYPES:
    _name = f"TestCommon_{_pe_type.replace('-', '_')}"
    globals()[_name] = _suite(_name, _tape_config(_pe_type), (TapeModel, TapeForCausalLM))
# a per-layer schedule as a preset, which follows any num_hidden_layers a test sets: ALiBi and NoPE layers in turn
TestCommon_schedule = _suite(
    "TestCommon_schedule",
    _tape_config("alibi", layer_pe_types="nope-every-2nd"),
    (TapeModel, TapeForCausalLM),
)
TestCommon_llama = _suite("TestCommon_llama", LlamaConfig, (LlamaModel, LlamaForCausalLM))
