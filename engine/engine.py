"""The public entry point: a base model, an optional draft head, and one generation at a time over them."""
from __future__ import annotations

import gc
import logging
import threading
from pathlib import Path
from typing import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .model.attention import use_wide_attention
from .model.cache import GrowingCache
from .draft.corpus import DEFAULT_CORPUS, CorpusIndex
from .draft.checkpoint import DEFAULT_HEAD, load_head
from .draft.drafter import Drafter
from .draft.head import DraftHead
from .decode.gate import HeadGate
from .decode.loop import check_prompt, decode
from .decode.round import Step
from .model.load import DEFAULT_BASE, DEFAULT_DEVICE, auto_dtype, load_base, resolve_dtype
from .model.packed import bf16_native, pack_linears, packable_dtypes
from .decode.params import DecodeParams
from .decode.prefixes import Prefix, PrefixStore
from .model.quant import GROUPED, QuantLinear, gguf_file, quantize_linears, resolve_kernels
from .model.target import Target
from .model.threads import ThreadGovernor

_ROLES = ("system", "user", "assistant")
log = logging.getLogger(__name__)


class Engine:
    """A base model, an optional draft head, and a lock so that one generation runs at a time."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        head: DraftHead | None = None,
        *,
        pack: bool = False,
        follow_load: bool = True,
        kernels: str = "float",
        gguf: Path | None = None,
        corpus: CorpusIndex | None = None,
    ):
        """pack: replace the CPU linear layers of model and head by oneDNN-packed ones (engine.model.packed) and, for a
        model wholly on the CPU, its attention by engine.model.attention's: every row of a forward then comes out the same
        bits whatever the batch, so verification agrees exactly with one-token decoding. Changes the model in place.
        follow_load: for a model on the CPU, give up threads to other busy processes between steps
        (engine.model.threads); the output does not depend on the thread count.
        kernels="q4" or "int8": first replace the base model's float32 linear layers by engine.model.quant's grouped
        ones (int8: on int8 activations), holding the groups of the GGUF file `gguf` where it has them, else
        quantizing (engine.model.quant.quantize_linears); a head on such a model is quantized to Q8_0, on the same kernels.
        corpus: the model's own replies to other prompts, in its tokenizer's ids, to draft from where the context
        has nothing (engine.draft.corpus)."""
        self.model, self.tokenizer, self.head, self.pack = model, tokenizer, head, pack
        vocab = model.config.get_text_config().vocab_size
        if corpus is not None and corpus.max_token >= vocab:
            raise ValueError(f"the corpus holds token id {corpus.max_token}, past this model's vocabulary of "
                             f"{vocab}: it was tokenized for another model")
        self.corpus = corpus
        grouped = kernels in GROUPED
        self.quantized_layers = quantize_linears(model, gguf, int8=kernels == "int8") if grouped else 0
        self.kernels = _kernels_of(model)
        if self.kernels in GROUPED and head is not None:  # drafts only, so its rounding never changes the output
            self.quantized_layers += quantize_linears(head, kind="Q8_0", int8=self.kernels == "int8")
        self.packed_layers = sum(pack_linears(m) for m in (model, head) if m is not None) if pack else 0
        self.wide_attention = pack and use_wide_attention(model)
        # Every row of a forward comes out the same bits whatever the batch: greedy EAGLE is plain decoding exactly.
        self.batch_invariant = self.wide_attention and model.dtype in packable_dtypes()
        if self.wide_attention and not self.batch_invariant:
            log.warning("%s linear layers cannot be packed on this CPU, so a tree forward may round differently "
                        "from one-token decoding and greedy EAGLE may differ from plain decoding: use float32",
                        str(model.dtype).removeprefix("torch."))
        text_config = model.config.get_text_config()
        self.target = Target(model, head.feature_layers(text_config.num_hidden_layers) if head else None)
        # A chat's next turn forwards only its new tokens where reusing a cache changes no bit (engine.decode.prefixes);
        # None: every generation prefills its whole prompt (the bench sets it so, to time prefills alike).
        self.prefixes = PrefixStore() if self.batch_invariant else None
        self._lock = threading.Lock()
        # What the head buys on this machine, measured over the rounds of every generation that asks for the gate
        # (DecodeParams.gate), so each answer starts from what the last ones measured.
        self.gate = HeadGate()
        on_cpu = model.get_output_embeddings().weight.device.type == "cpu"
        self.threads = ThreadGovernor() if follow_load and on_cpu else None
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.stop_ids = tuple(sorted(set(eos)))

    @classmethod
    def load(
        cls,
        base: str | None = None,
        head: str | Path | None = "default",
        *,
        device: str = DEFAULT_DEVICE,
        dtype: str = "auto",
        head_dtype: str | None = None,
        quantization: str = "none",
        attn: str = "sdpa",
        max_memory: str | None = None,
        pack: bool = True,
        follow_load: bool = True,
        kernels: str = "auto",
        corpus: str | list[str | Path] | None = "default",
    ) -> "Engine":
        """Load a base model and a head. head="default" is the shipped head for the embedded base, none otherwise;
        corpus="default" the self-distilled replies in data/selfdistill for the embedded base, none otherwise (else
        a list of record files: engine.draft.corpus, engine.draft.records).

        dtype "auto" is bfloat16 where the engine is exact and faster in it (see _auto_dtype), float32 elsewhere;
        quantization, attn and max_memory (a per-GPU cap for device="auto") are explained in engine.model.load;
        pack packs the linear layers that run on the CPU for oneDNN (engine.model.packed) and gives a model wholly on the
        CPU engine.model.attention's attention (whatever attn says), changing the model in place. follow_load: see __init__.
        head_dtype None: the base model's dtype, except bfloat16 for a packed head on a CPU with native bf16 beside
        float kernels (beside q4 or int8 it stays float32, for the Q8_0 kernels); the
        head's precision never changes the output (verification decides), only how fast and how well it drafts.
        kernels "auto" | "float" | "q4" | "int8": which CPU linear layers the base model runs
        (engine.model.quant.resolve_kernels); q4 and int8 run in float32, and it is that model that plain decoding and
        EAGLE both decode.
        """
        embedded = base in (None, "", DEFAULT_BASE)
        if head == "default":
            head = DEFAULT_HEAD if embedded and DEFAULT_HEAD.exists() else None
        if corpus == "default":
            corpus = DEFAULT_CORPUS if embedded else None
        if head and attn == "flash_attention_2":
            raise ValueError("flash_attention_2 cannot apply the tree mask that EAGLE verification needs: "
                             "use attn='sdpa' with a draft head (flash_attention_2 serves plain decoding only)")
        replies = CorpusIndex.from_files(corpus) if corpus else None  # a wrong file fails before the model loads
        gguf = gguf_file(base)
        kernels = resolve_kernels(kernels, device, dtype, pack, quantization, gguf)
        if dtype == "auto":
            dtype = "float32" if kernels in GROUPED else auto_dtype(device, quantization, pack)
        model, tokenizer = load_base(
            base, dtype=dtype, device=device, attn_implementation=attn, quantization=quantization, max_memory=max_memory
        )
        draft = _load_head(head, model, head_dtype, pack, kernels) if head else None
        return cls(model, tokenizer, draft, pack=pack, follow_load=follow_load, kernels=kernels, gguf=gguf,
                   corpus=replies)

    def with_head(self, head: str | Path, head_dtype: str | None = None) -> "Engine":
        """Another engine on this one's base model (shared, not copied) that drafts with another head: for comparing
        heads side by side. The two share one lock, as they share the model: one generation at a time."""
        other = Engine(self.model, self.tokenizer, _load_head(head, self.model, head_dtype, self.pack, self.kernels),
                       pack=self.pack, corpus=self.corpus)
        other._lock, other.threads = self._lock, self.threads
        return other

    @property
    def max_context(self) -> int:
        return self.target.max_context

    @property
    def exactness(self) -> str:
        """What lossless means where this engine runs, in words for users."""
        if self.batch_invariant:
            return ("bit-exact: on this CPU a tree forward gives every token the same bits as one-token decoding, so "
                    "greedy EAGLE output is plain decoding's, token for token")
        return ("lossless in distribution: here a tree forward and a one-token step run different kernels, so greedy "
                "output equals plain decoding's except where two tokens tie to within floating-point rounding")

    @torch.inference_mode()
    def next_token_logits(self, ids: list[int]) -> torch.Tensor:
        """The base model's logits [V] for the token after `ids`, from one plain forward (to explain a near-tie)."""
        with self._lock:
            hidden, _ = self.target.forward(torch.tensor(ids), self.target.new_cache())
            return self.target.logits(hidden[-1])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation in the model's chat template, ready for the assistant's reply."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("the conversation is empty: give at least one user message")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in _ROLES:
                raise ValueError(f"message {i} needs a role among {', '.join(_ROLES)}")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"message {i} has non-text content; only text messages are supported")
        if messages[-1]["role"] != "user":
            raise ValueError("the last message must come from the user")
        if not messages[-1]["content"].strip():
            raise ValueError("the last user message is empty")
        ids = self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def generate(self, prompt_ids: list[int], params: DecodeParams | None = None, **options) -> Iterator[Step]:
        """Stream Steps for prompt_ids. `options` change `params` (default DecodeParams()) as
        DecodeParams.with_options does. Waits for any other generation to finish first."""
        params = (params or DecodeParams()).with_options(**options)
        if params.method == "eagle" and self.head is None:
            raise ValueError("method 'eagle' needs a draft head; load one with head=... or use method='vanilla'")
        check_prompt(prompt_ids, self.max_context)
        return self._locked(prompt_ids, params)

    def _locked(self, prompt_ids: list[int], params: DecodeParams) -> Iterator[Step]:
        with self._lock:
            drafter = Drafter(self.head) if params.method == "eagle" else None
            kept = self.prefixes.take(prompt_ids, drafter is not None) if self.prefixes is not None else None
            if kept is not None and drafter is not None:
                drafter.reset(kept.head_cache)
            cache = kept.cache if kept is not None else self.target.new_cache()
            if self.threads is not None:
                self.threads.start()
            ids = list(prompt_ids)
            try:
                for step in decode(self.target, drafter, prompt_ids, params, self.stop_ids, cache, self.gate,
                                   self.corpus):
                    ids += step.tokens
                    yield step
                    if self.threads is not None:
                        self.threads.update()
            except GeneratorExit:  # closed at a yield: the caches hold what was yielded, a prefix worth keeping
                self._keep(ids, cache, drafter)
                raise
            self._keep(ids, cache, drafter)

    def _keep(self, ids: list[int], cache: GrowingCache, drafter: Drafter | None) -> None:
        if self.prefixes is not None:
            if drafter is not None:  # slots the gate deferred: the head's cache then covers the whole prefix
                drafter.catch_up()
            self.prefixes.put(Prefix(ids, cache, drafter.cache if drafter is not None and drafter.cache else None))

    def chat(self, messages: list[dict], params: DecodeParams | None = None, **options) -> Iterator[Step]:
        return self.generate(self.encode_chat(messages), params, **options)

    def chat_text(self, messages: list[dict], params: DecodeParams | None = None, **options) -> str:
        """Text in, text out: the assistant's whole reply."""
        ids = [tok for step in self.chat(messages, params, **options) for tok in step.tokens]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def oldest_turns_dropped(messages: list[dict]) -> Iterator[tuple[list[dict], int]]:
    """The conversation, then without its oldest exchange (a user message and the answer to it), and so on down to
    the last user message: (messages kept, how many were dropped). A leading system message is always kept; this is
    how a chat too long for the context gets in (the app's turns, training prompts from later turns)."""
    system = 1 if messages and messages[0]["role"] == "system" else 0
    for dropped in range(0, max(1, len(messages) - system), 2):
        yield messages[:system] + messages[system + dropped:], dropped


def _kernels_of(model: PreTrainedModel) -> str:
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return "float" if not layers else "int8" if layers[0].int8 else "q4"


def freeze_heap() -> None:
    """For a process that keeps one engine for its lifetime (the app, the bench), once it is loaded: collect
    garbage, then take every object alive out of the collector's sight (gc.freeze). What start-up leaves (torch,
    transformers, the model's modules, a UI) lives as long as the process, and a full collection walking it
    (~400-550 k objects) stalls whichever decoding step it lands in by a quarter of a second: often the first
    answer's, where one stalled timed plain step made the app's meter overstate EAGLE's speedup 2x. Engine.load
    does not call it: frozen objects are never collected, so a process loading engine after engine would keep
    every earlier one's cyclic garbage (~0.3 GB each)."""
    gc.collect()
    gc.freeze()


def _load_head(head: str | Path, model: PreTrainedModel, head_dtype: str | None, pack: bool, kernels: str) -> DraftHead:
    """Load a head for `model`; head_dtype None means bfloat16 for a packed head on a CPU with native bf16 beside
    float kernels, else the base model's dtype: beside q4 or int8 that is float32, which Engine quantizes to Q8_0 and
    drafts with in one kernel call per layer (engine.draft.fused.FusedEagle3), ~2x faster than the bf16 head's modules."""
    on_cpu = model.get_output_embeddings().weight.device.type == "cpu"  # also for device="auto" without GPUs
    if head_dtype is None and pack and on_cpu and bf16_native() and kernels not in GROUPED:
        head_dtype = "bfloat16"
    return load_head(head, model, resolve_dtype(head_dtype) if head_dtype else None)
