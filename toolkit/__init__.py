"""toolkit: pretrain and fine-tune large language models on Lightning Fabric.

Importing this package is cheap on purpose: heavy libraries (torch, lightning, litdata, peft) are
imported inside the modules that need them, so that `toolkit --help` answers at once.
"""

__version__ = "0.1.0"
