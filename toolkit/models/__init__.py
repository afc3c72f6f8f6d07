"""Model configurations, presets and the GPT architecture.

Importing this package does not import torch; import `toolkit.models.gpt` for the module itself.
"""

from toolkit.models.config import Config

__all__ = ["Config"]
