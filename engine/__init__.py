"""Lossless EAGLE speculative decoding for Hugging Face causal LMs.

    from engine import Engine
    engine = Engine.load()                       # embedded SmolLM2-135M-Instruct + the shipped EAGLE-3 head
    for step in engine.chat([{"role": "user", "content": "Hi!"}]):
        print(engine.tokenizer.decode(step.tokens), end="", flush=True)
"""
from .draft.checkpoint import CheckpointError
from .engine import Engine, freeze_heap, oldest_turns_dropped
from .decode.loop import ContextTooLong
from .decode.round import Step
from .decode.params import METHODS, DecodeParams
from .draft.tree import DynamicTree, StaticTree
from .decode.accept import Sampling

__all__ = ["Engine", "Step", "DecodeParams", "Sampling", "DynamicTree", "StaticTree", "CheckpointError",
           "ContextTooLong", "METHODS", "freeze_heap", "oldest_turns_dropped"]
