"""Model configurations, presets and the GPT architecture.

Importing this package does not import torch; import `toolkit.models.gpt` for the model itself and
the other modules here for its layers (attention, mlp, norms, rope, kv_cache, loss).
"""

from toolkit.models.config import Config

# Label value the loss skips (masked prompt tokens, padding). Defined here, free of torch, so that
# the data modules that write it and the model that skips it share one value.
IGNORE_INDEX = -100
# The fused loss (toolkit.models.loss) computes this many bytes of float32 logits at a time (at
# least one row). Here, free of torch, so that the memory estimate (toolkit.memory) reads it too.
LOSS_CHUNK_BYTES = 128 * 2**20

__all__ = ["Config", "IGNORE_INDEX", "LOSS_CHUNK_BYTES"]
