"""The state pool: per-request recurrent state of state-space and hybrid models, beside the paged KV pool."""

from nnrun.state.mixers import MixerInfo, adapt_mixers
from nnrun.state.pool import StatePool
from nnrun.state.serving import serve_states, state_pool_for

__all__ = ["MixerInfo", "StatePool", "adapt_mixers", "serve_states", "state_pool_for"]
