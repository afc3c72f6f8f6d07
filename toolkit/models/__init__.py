"""Model configurations, presets and the GPT architecture.

Importing this package does not import torch; import `toolkit.models.gpt` for the module itself.
"""

from toolkit.models.config import Config

# Label value the loss skips (masked prompt tokens, padding). Defined here, free of torch, so that
# the data modules that write it and the model that skips it share one value.
IGNORE_INDEX = -100

__all__ = ["Config", "IGNORE_INDEX"]
