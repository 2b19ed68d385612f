"""tapelm: TAPE (contextualised equivariant positional encoding) and its baselines as Hugging Face models.

Importing the package registers `TapeConfig` and the models with transformers' Auto classes. `register_encoding`
adds anyone's encoding to the registry every `pe_type` is looked up in (an installed package does it through the
`tapelm.encodings` entry points); `tapelm.testing` holds it to the laws tapelm's own encodings obey.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config import PE_TYPES, TapeConfig
from .conversion import from_pretrained_llama
from .modeling import TapeForCausalLM, TapeModel, TapePreTrainedModel
from .positional import encoding_names, register_encoding

AutoConfig.register("tape", TapeConfig, exist_ok=True)
AutoModel.register(TapeConfig, TapeModel, exist_ok=True)
AutoModelForCausalLM.register(TapeConfig, TapeForCausalLM, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "TapeConfig",
    "TapeModel",
    "TapeForCausalLM",
    "TapePreTrainedModel",
    "PE_TYPES",
    "from_pretrained_llama",
    "encoding_names",
    "register_encoding",
    "__version__",
]
