"""The public entry point: a base model, an optional draft head, and one generation at a time over them."""
from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .decode.costs import row_cost
from .decode.gate import HeadGate
from .decode.loop import check_prompt, decode
from .decode.params import DecodeParams
from .decode.prefixes import Prefix, PrefixStore
from .decode.round import Step
from .draft.checkpoint import load_head
from .draft.context import ChainAcceptance
from .draft.corpus import CorpusIndex
from .draft.drafter import Drafter
from .draft.head import DraftHead
from .model.cache import GrowingCache
from .model.fused import why_not_fused
from .model.gguf_match import quantize_linears
from .model.gguf_tensors import GgufFile
from .model.kernel_policy import Kernels
from .model.load import DEFAULT_BASE, resolve_dtype
from .model.packed import PackedLinear, bf16_native, pack_linears
from .model.quant import QuantLinear
from .model.target import Target
from .model.target_load import LoadedBase, load_target, prepare_target
from .model.threads import ThreadGovernor
from .options import LoadOptions

_ROLES = ("system", "user", "assistant")
PLAIN_TURNS = "\n\n"  # between a conversation's messages, for a model without a chat template
log = logging.getLogger(__name__)
# A head beside grouped kernels: in Q4_1 but fc, in Q8_0. A drafting round reads the head's weights from memory, where
# the base's forward has just pushed them out of the caches, so half the bytes draft faster; the default trees keep
# their tau, while fc (three layers' features fused) in Q4_1 costs a deep tree's (docs/benchmarks.md, "Drafting cost").
HEAD_KINDS = {"fc": "Q8_0"}


@dataclass(frozen=True)
class Sources:
    """Where the engine's models came from, as a user named them."""

    base: str
    head: str | None


@dataclass(frozen=True)
class Description:
    """What an engine runs, in words: which model, which tensor types, which head, on which path."""

    base: str
    architecture: str
    tensor_types: dict[str, int]  # a GGUF base's tensors by type
    head: str | None
    head_kind: str | None
    head_layout: str | None  # the checkpoint layout it was read from: official, specforge or speculators
    kernels: str  # "int8", "q4" or "float"
    fused: bool  # the whole decoder in one kernel call (the fast exact path)
    why_not_fused: str | None
    threads: int
    device: str
    dtype: str
    exact: bool  # tree rows bit-identical to one-token steps
    chats: bool  # prompts go through the chat template; else plain text is continued

    @property
    def path(self) -> str:
        if self.fused:
            return f"fast exact path ({self.kernels} kernels, the decoder in one call)"
        return f"{self.kernels} path through transformers' layers ({self.why_not_fused})"

    def lines(self) -> list[str]:
        types = ", ".join(f"{count} {kind}" for kind, count in self.tensor_types.items())
        head = (f"{self.head} ({self.head_kind}, {self.head_layout} layout)" if self.head
                else "none: plain decoding only")
        prompts = "chat template" if self.chats else "no chat template: completes plain text"
        return [f"base: {self.base} ({self.architecture}{'; ' + types if types else ''}; {prompts})",
                f"head: {head}",
                f"runs on: {self.device}, {self.dtype}, {self.threads} threads; {self.path}; "
                f"{'tree rows bit-identical to one-token steps' if self.exact else 'lossless in distribution'}"]


class Engine:
    """A base model, an optional draft head, and a lock so that one generation runs at a time."""

    def __init__(
        self,
        base: LoadedBase,
        head: DraftHead | None = None,
        *,
        follow_load: bool = True,
        corpus: CorpusIndex | None = None,
        reuse_prefixes: bool = True,
        chat_template: bool = True,
        sources: Sources | None = None,
    ):
        """Build the engine over a loaded base (engine.model.target_load: its kernels, packing and attention are
        final here) and a head, which goes onto the base's kernels: beside grouped ones quantized too (HEAD_KINDS; its
        rounding changes drafts, never the output), beside a packed base packed.
        follow_load: on the CPU, give up threads to other busy processes between steps (engine.model.threads); the
        output does not depend on the thread count.
        corpus: the model's own replies to other prompts, in its tokenizer's ids, to draft from where the context
        has nothing (engine.draft.corpus).
        reuse_prefixes: a chat's next turn forwards only its new tokens where that changes no bit
        (engine.decode.prefixes); False: every generation prefills its whole prompt.
        chat_template: False prompts the model with plain text even where its tokenizer has a chat template.
        sources: where model and head came from, as the user named them (for description())."""
        self.base, self.model, self.tokenizer = base, base.model, base.tokenizer
        self.kernels, self.pack, self.batch_invariant = base.kernels, base.pack, base.exact
        self.head = _beside(head, base) if head is not None else None
        self.sources = sources or Sources("a model in memory", "a head in memory" if head is not None else None)
        # A model chats where its tokenizer has a chat template; a base model without one completes plain text.
        self.chats = chat_template and has_chat_template(self.tokenizer)
        self.corpus = _checked_corpus(corpus, self.model)
        self._build_collaborators(follow_load, reuse_prefixes)

    @property
    def quantized_layers(self) -> int:
        """The linear layers of base and head on the grouped kernels."""
        return self._count(QuantLinear)

    @property
    def packed_layers(self) -> int:
        """The linear layers of base and head packed by oneDNN."""
        return self._count(PackedLinear)

    def _count(self, kind: type) -> int:
        return sum(isinstance(m, kind) for part in (self.model, self.head) if part is not None for m in part.modules())

    def _build_collaborators(self, follow_load: bool, reuse_prefixes: bool) -> None:
        """The base model as the loop sees it, kept prefixes, the head gate, the thread governor, the stop ids."""
        layers = self.model.config.get_text_config().num_hidden_layers
        self.target = Target(self.model, self.head.feature_layers(layers) if self.head else None, self.base.fused)
        # Reusing a kept cache is exact only where every row's bits are batch-invariant.
        self.prefixes = PrefixStore() if reuse_prefixes and self.batch_invariant else None
        self._lock = threading.Lock()
        # What the head buys on this machine, measured over the rounds of every generation that asks for the gate
        # (DecodeParams.gate), so each answer starts from what the last ones measured.
        self.gate = HeadGate()
        # How often the context's chains are right, by match length, over every generation that drafts from the
        # context: with this machine's cost of a verified row, how long a chain pays (created at the first one).
        self.chain_acceptance: ChainAcceptance | None = None
        on_cpu = self.model.get_output_embeddings().weight.device.type == "cpu"
        self.threads = ThreadGovernor() if follow_load and on_cpu else None
        self.stop_ids = _stop_ids(self.model, self.tokenizer)

    @classmethod
    def over(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, head: DraftHead | None = None, *,
             kernels: Kernels | str = Kernels.FLOAT, pack: bool = False, gguf: GgufFile | None = None,
             **settings) -> "Engine":
        """An engine over a model already in memory (a test's, a tool's), made ready as a loaded one is
        (engine.model.target_load.prepare_target: kernels="q4" or "int8" puts its float32 layers on the grouped
        kernels, with the groups of the GGUF file `gguf` where they match, else quantized; pack packs its float
        layers and gives a model wholly on the CPU the batch-invariant attention, so verification agrees exactly
        with one-token decoding); `settings` are __init__'s."""
        return cls(prepare_target(model, tokenizer, kernels, pack=pack, gguf=gguf), head, **settings)

    @classmethod
    def load(cls, base: str | None = None, head: str | Path | None = "default", **options) -> "Engine":
        """Load a base model and a head: Engine.from_options(LoadOptions(base, head, **options)); see
        engine.options.LoadOptions for every option, its default and what it means."""
        return cls.from_options(LoadOptions(base=base, head=head, **options))

    @classmethod
    def from_options(cls, options: LoadOptions) -> "Engine":
        """Resolve the options, read the corpus (a wrong file fails before the model loads), load the base
        (engine.model.target_load.load_target), attach the head, and build the engine over them."""
        options = options.resolved()
        corpus = CorpusIndex.from_files(list(options.corpus)) if options.corpus else None
        base = load_target(options.target)
        head = _load_head(options.head, base, options.head_dtype) if options.head else None
        embedded = f"{DEFAULT_BASE} (embedded: {base.gguf.path if base.gguf else None})"
        sources = Sources(options.base or embedded, str(options.head) if options.head else None)
        engine = cls(base, head, follow_load=options.follow_load, corpus=corpus,
                     reuse_prefixes=options.reuse_prefixes, chat_template=options.chat_template, sources=sources)
        for line in engine.description().lines():
            log.info(line)
        return engine

    def with_head(self, head: str | Path, head_dtype: str | None = None) -> "Engine":
        """Another engine on this one's base model (shared, not copied) that drafts with another head: for comparing
        heads side by side. The two share one lock, as they share the model: one generation at a time."""
        other = Engine(self.base, _load_head(head, self.base, head_dtype), corpus=self.corpus,
                       reuse_prefixes=self.prefixes is not None, chat_template=self.chats,
                       sources=replace(self.sources, head=str(head)))
        other._lock, other.threads = self._lock, self.threads
        return other

    @property
    def max_context(self) -> int:
        return self.target.max_context

    def description(self) -> Description:
        """What runs: for the log at load and the app's status line."""
        config = self.model.config.get_text_config()
        return Description(
            base=self.sources.base, architecture=config.model_type,
            tensor_types=self.base.gguf.tensor_types if self.base.gguf else {},
            head=self.sources.head, head_kind=self.head.kind if self.head is not None else None,
            head_layout=self.head.layout if self.head is not None else None,
            kernels=self.kernels, fused=self.target.fused is not None,
            why_not_fused=None if self.target.fused is not None else why_not_fused(self.model),
            threads=torch.get_num_threads(), device=str(self.target.device), dtype=str(self.model.dtype).split(".")[-1],
            exact=self.batch_invariant, chats=self.chats)

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
        """Token ids of a conversation in the model's chat template, ready for the assistant's reply; for a model that
        does not chat (Engine.chats), its messages as one plain text to continue."""
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
        return encode_messages(self.tokenizer, messages, self.chats)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text for the model to continue (with the tokenizer's own start token, if it adds one)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the prompt is empty")
        return list(self.tokenizer(text)["input_ids"])

    def complete(self, text: str, params: DecodeParams | None = None, **options) -> Iterator[Step]:
        """Continue plain text, whether or not the model has a chat template."""
        return self.generate(self.encode_text(text), params, **options)

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
            if params.floors_at_row_cost:
                params = params.with_row_cost(self._chain_acceptance().row_cost)
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
                                   self.corpus, self._chain_acceptance() if params.sizes_chains else None):
                    ids += step.tokens
                    yield step
                    if self.threads is not None:
                        self.threads.update()
            except GeneratorExit:  # closed at a yield: the caches hold what was yielded, a prefix worth keeping
                self._keep(ids, cache, drafter)
                raise
            self._keep(ids, cache, drafter)

    def _chain_acceptance(self) -> ChainAcceptance:
        if self.chain_acceptance is None:
            self.chain_acceptance = ChainAcceptance(row_cost(self.target))
        return self.chain_acceptance

    def _keep(self, ids: list[int], cache: GrowingCache, drafter: Drafter | None) -> None:
        if self.prefixes is not None:
            if drafter is not None:  # the slots left to a next proposal: the head's cache then covers the prefix
                drafter.catch_up(logits=False)
            self.prefixes.put(Prefix(ids, cache, drafter.cache if drafter is not None and drafter.cache else None))

    def chat(self, messages: list[dict], params: DecodeParams | None = None, **options) -> Iterator[Step]:
        return self.generate(self.encode_chat(messages), params, **options)

    def chat_text(self, messages: list[dict], params: DecodeParams | None = None, **options) -> str:
        """Text in, text out: the assistant's whole reply."""
        ids = [tok for step in self.chat(messages, params, **options) for tok in step.tokens]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether a model chats: its tokenizer has a chat template (a base model without one continues plain text)."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: list[dict], chats: bool,
                    add_generation_prompt: bool = True) -> list[int]:
    """A conversation's token ids: in the chat template (ready for the assistant's reply with add_generation_prompt)
    where the model chats, else its messages as one plain text to continue. One encoding for the engine's prompts
    and the training data's, so a head trains on the prompts it will draft after."""
    if not chats:
        return list(tokenizer(PLAIN_TURNS.join(m["content"] for m in messages))["input_ids"])
    ids = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                        add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def oldest_turns_dropped(messages: list[dict]) -> Iterator[tuple[list[dict], int]]:
    """The conversation, then without its oldest exchange (a user message and the answer to it), and so on down to
    the last user message: (messages kept, how many were dropped). A leading system message is always kept; this is
    how a chat too long for the context gets in (the app's turns, training prompts from later turns)."""
    system = 1 if messages and messages[0]["role"] == "system" else 0
    for dropped in range(0, max(1, len(messages) - system), 2):
        yield messages[:system] + messages[system + dropped:], dropped


def _checked_corpus(corpus: CorpusIndex | None, model: PreTrainedModel) -> CorpusIndex | None:
    vocab = model.config.get_text_config().vocab_size
    if corpus is not None and corpus.max_token >= vocab:
        raise ValueError(f"the corpus holds token id {corpus.max_token}, past this model's vocabulary of "
                         f"{vocab}: it was tokenized for another model")
    return corpus


def _stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every token that ends an answer: the generation config's end tokens and the tokenizer's."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return tuple(sorted(set(eos)))


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


def _load_head(head: str | Path, base: LoadedBase, head_dtype: str | None) -> DraftHead:
    """Load a head for `base`; head_dtype None means bfloat16 for a packed head on a CPU with native bf16 beside
    float kernels, else the base model's dtype: beside q4 or int8 that is float32, which Engine quantizes (HEAD_KINDS) and
    drafts with in one kernel call a head run (engine.draft.fused.FusedEagle3), without Python between its ops."""
    on_cpu = base.model.get_output_embeddings().weight.device.type == "cpu"  # also for device="auto" without GPUs
    if head_dtype is None and base.pack and on_cpu and bf16_native() and not base.kernels.grouped:
        head_dtype = "bfloat16"
    return load_head(head, base.model, resolve_dtype(head_dtype) if head_dtype else None)


def _beside(head: DraftHead, base: LoadedBase) -> DraftHead:
    """`head` on `base`'s kernels, in place: beside grouped ones quantized (drafts only: its rounding never changes the
    output), beside a packed base packed."""
    if base.kernels.grouped:
        quantize_linears(head, kind="Q4_1", int8=base.kernels is Kernels.INT8, kinds=HEAD_KINDS)
    if base.pack:
        pack_linears(head)
    return head
