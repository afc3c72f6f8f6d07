"""Data modules. Importing this package is cheap: litdata is imported only when data is prepared or loaded."""

from toolkit.data.chat import Chat
from toolkit.data.hf_datasets import HFChat, HFInstruct, HFPreference, HFText
from toolkit.data.instruct import JSON, Alpaca, InstructData
from toolkit.data.local_corpus import PythonStdlib
from toolkit.data.preference import Preference
from toolkit.data.streams import PretrainData, StreamMix, TextFiles

__all__ = [
    "Alpaca", "Chat", "HFChat", "HFInstruct", "HFPreference", "HFText", "InstructData", "JSON", "Preference",
    "PretrainData", "PythonStdlib", "StreamMix", "TextFiles",
]
