"""Data modules. Importing this package is cheap: litdata is imported only when data is prepared or loaded."""

from toolkit.data.chat import Chat
from toolkit.data.instruct import JSON, Alpaca, InstructData
from toolkit.data.local_corpus import PythonStdlib
from toolkit.data.streams import PretrainData, StreamMix, TextFiles

__all__ = ["Alpaca", "Chat", "InstructData", "JSON", "PretrainData", "PythonStdlib", "StreamMix", "TextFiles"]
