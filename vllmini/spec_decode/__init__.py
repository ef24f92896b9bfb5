"""Speculative decoding (vLLM's ``speculative_config``): a proposer guesses a sequence's next
tokens (n-gram prompt lookup, or a draft model), one forward scores them all, and the sampler
keeps the longest run it agrees with."""
from vllmini.spec_decode.config import SpeculativeConfig
from vllmini.spec_decode.draft_model import DraftModelProposer, DraftRequest
from vllmini.spec_decode.ngram_proposer import NgramProposer
from vllmini.spec_decode.speculator import Speculator
from vllmini.spec_decode.stats import SpecDecodingStats

__all__ = ["DraftModelProposer", "DraftRequest", "NgramProposer", "SpecDecodingStats", "SpeculativeConfig", "Speculator"]
