"""specdecode: lossless speculative decoding for Hugging Face causal language models."""
from .host import restart_if_command

restart_if_command()  # the `specdecode` command runs itself again with huge pages, before torch loads (hugepages.py)
from .engine import METHODS, Engine
from .loop import speculative_decode
from .errors import SpecDecodeError
from .sampling import SamplingParams, probs_from_logits
from .stats import Generation, Stats
from .verify import verify

__all__ = ["Engine", "Generation", "Stats", "METHODS", "SpecDecodeError", "SamplingParams",
           "probs_from_logits", "speculative_decode", "verify"]
__version__ = "0.1.0"
