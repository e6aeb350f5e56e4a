"""Lossless EAGLE speculative decoding for Hugging Face causal LMs and GGUF files.

    from engine import Engine
    engine = Engine.load()                       # embedded SmolLM2-135M-Instruct + the shipped EAGLE-3 head
    for step in engine.chat([{"role": "user", "content": "Hi!"}]):
        print(engine.tokenizer.decode(step.tokens), end="", flush=True)
"""
from .decode.accept import Sampling
from .decode.loop import ContextTooLong
from .decode.params import METHODS, DecodeParams
from .decode.round import Step
from .draft.checkpoint import CheckpointError
from .draft.tree import DynamicTree, StaticTree
from .engine import Engine, freeze_heap, oldest_turns_dropped
from .options import LoadOptions

__all__ = ["Engine", "LoadOptions", "Step", "DecodeParams", "Sampling", "DynamicTree", "StaticTree",
           "CheckpointError", "ContextTooLong", "METHODS", "freeze_heap", "oldest_turns_dropped"]
