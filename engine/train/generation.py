"""Batched generation for self-distillation: dozens of replies decoded in one forward, each the base model's own.

A head learns what the base model will say, so a regenerated reply must be exactly what the engine's plain
greedy decoding gives for that prompt alone, on the model the engine decodes (load_generation_model). On the CPU
the grouped kernels of a GGUF base with the fixed-order attention, or the packed linear layers (engine.model.packed) with
float64-summed attention, compute every row alike whatever else shares the forward, so a batch of rows of
different lengths still gives each row its own tokens. What makes it fast:

- float models: attention summed in float64 like engine.model.attention's, in products shaped for one-token rows: float64
  sums agree to ~1e-16 in any order, so the rows round to the same bits;
- one KV cache allocated up front, a slot per row, each row written at its own position (no concatenation per
  step); for float64 attention kept in float64, so keys are widened once, when written; on the grouped kernels in
  float16, as the engine caches them (engine.model.quant.kv_dtype);
- a row leaves the batch as soon as its reply ends, and its slot takes the next prompt (continuous batching);
  prompts enter shortest first, so the rows of a step need keys of similar length, and are prefilled in groups
  of similar length, so little of a prefill is padding;
- the LM head runs only where a token is picked: the last prompt position, then each new token.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch
from torch import nn
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from ..model.fused import sliding_window
from ..model.load import load_base
from ..model.packed import bf16_native, pack_linears
from ..model.quant import kv_dtype
from ..model.target_load import LoadedBase, load_target
from ..decode.accept import Sampling, greedy_tokens
from ..options import LoadOptions

FUSED_WIDE = "eagle_wide_fused"
GROUPED_ATTENTION = "eagle_grouped"
PREFILL_TOKENS = 2048  # padded prompt tokens per prefill forward: few pad tokens, activations of a few MB a layer
CACHE_SPARE = 0.25  # of a GPU's free memory left beside the slots' cache, for the forwards' activations


def generation_dtype(device: str) -> str:
    """"auto" for generation: bfloat16 on GPUs and on CPUs that multiply it natively, float32 elsewhere (an AVX2
    CPU emulates bf16 and oneDNN cannot pack it, which makes it slower than float32)."""
    return "bfloat16" if torch.device(device).type == "cuda" or bf16_native() else "float32"


def load_grouped_base(base: str | None, device: str, dtype: str, kernels: str) -> LoadedBase | None:
    """The base the engine decodes (engine.model.target_load.load_target, with Engine.load's kernels: "auto" is int8
    on the CPU) where it is on the grouped kernels, whose rows are batch-invariant in transformers' forward too; None
    where the kernels resolve to float layers."""
    target = LoadOptions(base=base, head=None, device=device, dtype=dtype, kernels=kernels, corpus=None).target
    return load_target(target) if target.kernels.grouped else None


def load_generation_model(base: str | None, device: str, gen_dtype: str = "auto", kernels: str = "auto"):
    """(model, tokenizer) whose plain greedy decoding the replies are: the model the engine decodes
    (load_grouped_base), else the base packed in `gen_dtype` with float64-summed attention."""
    loaded = load_grouped_base(base, device, gen_dtype, kernels)
    if loaded is not None:
        return loaded.model, loaded.tokenizer
    model, tokenizer = load_base(base, dtype=generation_dtype(device) if gen_dtype == "auto" else gen_dtype,
                                 device=device)
    prepare_model(model)
    return model, tokenizer


def _grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                       scaling: float | None, sums: torch.dtype) -> torch.Tensor:
    """Attention with each key/value head's query heads taken together, so keys are never repeated per query head:
    query [B, H, T, D], key/value [B, Hkv, L, D], an additive mask [B, 1, T, L]; sums in `sums`; returns
    [B, T, H, D] in the query's dtype. Keys times queries (L x D by D x G*T) suits float64 matrix kernels better
    than queries times keys, whose rows are few."""
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    grouped = query.to(sums).reshape(batch, kv_heads, groups * rows, dim)
    scores = (key.to(sums) @ grouped.transpose(-1, -2)).transpose(-1, -2)
    scale = dim**-0.5 if scaling is None else scaling
    scores = scores.view(batch, kv_heads, groups, rows, length) * scale + attention_mask.to(sums)[:, :, None]
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * rows, length)
    out = (probs @ value.to(sums)).view(batch, heads, rows, dim)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def fused_wide_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """engine.model.attention.wide_attention's float64 sums, shaped for a batch of one-token rows."""
    return _grouped_attention(query, key, value, attention_mask, scaling, torch.float64), None


def grouped_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The same in the query's dtype, for a GPU: SDPA given a mask repeats every key and value for each query head
    (threefold for SmolLM2), which in a batch of thousands of rows costs more than the attention itself."""
    return _grouped_attention(query, key, value, attention_mask, scaling, query.dtype), None


AttentionInterface.register(FUSED_WIDE, fused_wide_attention)
AttentionMaskInterface.register(FUSED_WIDE, eager_mask)
AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
AttentionMaskInterface.register(GROUPED_ATTENTION, eager_mask)


def prepare_model(model: PreTrainedModel) -> None:
    """The engine's CPU fast path (pack=True) for generation: packed linear layers and, for a model wholly on the
    CPU, attention summed in float64 (fused_wide_attention). Changes the model in place."""
    pack_linears(model)
    if all(p.device.type == "cpu" for p in model.parameters()):
        model.set_attn_implementation(FUSED_WIDE)


class SlotCache(Cache):
    """Keys and values for `slots` rows of up to `capacity` tokens, preallocated. Before each forward, `place` says
    which rows it writes, at which positions, and which keys attention reads back."""

    def __init__(self, model: PreTrainedModel, slots: int, capacity: int):
        super().__init__(layers=[])
        layers, heads, dim, dtype = self.layout(model)
        shape, device, self.capacity = (slots, heads, capacity, dim), model.device, capacity
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.place(torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long), slice(0, 0), 0)

    @staticmethod
    def layout(model: PreTrainedModel) -> tuple[int, int, int, torch.dtype]:
        """(layers, key/value heads, head dim, dtype) of the cache for `model`."""
        config = model.config.get_text_config()
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = torch.float64 if config._attn_implementation == FUSED_WIDE else kv_dtype(model) or model.dtype
        return config.num_hidden_layers, config.num_key_value_heads, dim, dtype

    @classmethod
    def slot_bytes(cls, model: PreTrainedModel, capacity: int) -> int:
        """Bytes of keys and values one slot of `capacity` tokens takes."""
        layers, heads, dim, dtype = cls.layout(model)
        return 2 * layers * heads * capacity * dim * dtype.itemsize

    def place(self, rows: torch.Tensor, positions: torch.Tensor, read: slice | torch.Tensor, width: int) -> None:
        """The next forward writes rows [R] at positions [R, T] and returns keys [0, width) of the rows `read`."""
        device = self.keys[0].device
        self._write = (rows.to(device)[:, None], slice(None), positions.to(device))
        self._read = read if isinstance(read, slice) else read.to(device)
        self._width = width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self._write] = key_states.transpose(1, 2).to(keys.dtype)
        values[self._write] = value_states.transpose(1, 2).to(values.dtype)
        return keys[self._read, :, : self._width], values[self._read, :, : self._width]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A bool visibility [R, T, L] as the additive [R, 1, T, L] mask transformers passes to attention as it is."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=device)
    return bias.masked_fill_(~visible.to(device), torch.finfo(dtype).min)[:, None]


def layer_masks(visible: torch.Tensor, positions: torch.Tensor, window: int | None, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask for visibility [R, T, L] of queries at positions [R, T] over keys at positions 0..L-1; for a
    model with sliding-window layers one per layer type, the sliding layers' without the keys `window` or more
    positions back (transformers uses a given mask as it is in every layer, so it must say so itself)."""
    mask = additive_mask(visible, dtype, device)
    if window is None:
        return mask
    near = torch.arange(visible.shape[-1]) > positions[..., None] - window
    return {"full_attention": mask, "sliding_attention": additive_mask(visible & near, dtype, device)}


class BatchGenerator:
    """Replies to many prompts, `slots` at a time; see the module docstring for why it is shaped so."""

    def __init__(self, model: PreTrainedModel, prompts: list[list[int]], stops: list[int], max_new_tokens: int,
                 slots: int = 64, temperature: float = 0.0, seed: int = 0, prefill_tokens: int = PREFILL_TOKENS,
                 refill: int = 1):
        """`refill`: free slots that wait for one another before a prefill fills them. 1 suits a CPU, where a
        forward costs what its tokens cost; on a GPU a forward of a few rows costs about what one of all rows does, so
        prefilling each freed slot alone would take as long as decoding every row."""
        check_prompts(model, prompts, max_new_tokens, slots)
        self.model, self.prompts, self.max_new_tokens = model, prompts, max_new_tokens
        self.prefill_tokens, self.refill = prefill_tokens, max(1, refill)
        self.body, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        self.window = sliding_window(model)
        self.sampling = Sampling(temperature)
        self.generator = torch.Generator().manual_seed(seed)
        self.stops = torch.tensor(sorted(set(stops)), dtype=torch.long)
        self.queue = deque(sorted(range(len(prompts)), key=lambda i: len(prompts[i])))
        capacity = max(map(len, prompts)) + max_new_tokens
        slots = slots_that_fit(model, capacity, min(slots, len(prompts)))
        self.cache = SlotCache(model, slots, capacity)
        self.owner = torch.full((slots,), -1, dtype=torch.long)  # prompt index per slot; -1: free
        self.lengths = torch.zeros(slots, dtype=torch.long)  # tokens in the cache per slot
        self.count = torch.zeros(slots, dtype=torch.long)  # reply tokens per slot
        self.replies = torch.zeros(slots, max_new_tokens, dtype=torch.long)

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        """(prompt index, reply) as each reply ends: after its first stop token (kept) or max_new_tokens."""
        while True:
            free = (self.owner < 0).nonzero().flatten()
            if self.queue and len(free) >= min(self.refill, len(self.queue), len(self.owner)):
                self.prefill(free[: self.admissible(len(free))])
            elif len(free) == len(self.owner):
                return
            else:
                self.decode_step()
            yield from self.harvest()

    def admissible(self, free: int) -> int:
        """How many of the next prompts one prefill takes: up to `free`, within prefill_tokens once padded to the
        longest (the queue is sorted, so that is the last; one prompt always goes)."""
        count, most = 1, min(free, len(self.queue))
        while count < most and (count + 1) * len(self.prompts[self.queue[count]]) <= self.prefill_tokens:
            count += 1
        return count

    @torch.inference_mode()
    def prefill(self, slots: torch.Tensor) -> None:
        """Start the next prompts in free slots: one forward over them, right-padded, picks each first token."""
        chosen = [self.queue.popleft() for _ in range(len(slots))]
        lengths = torch.tensor([len(self.prompts[i]) for i in chosen])
        width = int(lengths.max())
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        for row, index in enumerate(chosen):
            ids[row, : lengths[row]] = torch.tensor(self.prompts[index])
        positions = torch.arange(width).expand(len(chosen), width)
        self.cache.place(slots, positions, slots, width)
        causal = torch.ones(width, width, dtype=torch.bool).tril().expand(len(chosen), width, width)
        hidden = self.forward(ids, positions, causal)
        self.owner[slots], self.lengths[slots], self.count[slots] = torch.tensor(chosen), lengths, 0
        self.record(slots, self.pick(hidden[torch.arange(len(chosen)), lengths - 1]))

    @torch.inference_mode()
    def decode_step(self) -> None:
        """One token for every live row; the rows run as one slice of the cache, up to the last live slot."""
        live = self.owner >= 0
        top = int(live.nonzero().max()) + 1
        rows, positions = torch.arange(top), self.lengths[:top, None]
        width = int(positions.max()) + 1
        self.cache.place(rows, positions, slice(0, top), width)
        visible = (torch.arange(width) <= positions)[:, None, :]
        last = self.replies[rows, (self.count[:top] - 1).clamp(min=0)]
        tokens = self.pick(self.forward(last[:, None], positions, visible)[:, 0])
        live = live[:top]
        self.lengths[:top] += live
        self.record(rows[live], tokens[live])

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        device = self.lm_head.weight.device
        masks = layer_masks(visible, positions, self.window, self.model.dtype, device)
        out = self.body(input_ids=ids.to(device), position_ids=positions.to(device), past_key_values=self.cache,
                        attention_mask=masks, use_cache=True)
        return out.last_hidden_state

    def pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next tokens [R] from final hidden states [R, H]: argmax, or draws from the tempered distribution."""
        logits = self.lm_head(hidden).float()
        if self.sampling.greedy:
            return torch.tensor(greedy_tokens(logits), dtype=torch.long)  # numpy's argmax on the CPU
        return torch.multinomial(self.sampling.probs(logits).cpu(), 1, generator=self.generator)[:, 0]

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self.replies[slots, self.count[slots]] = tokens
        self.count[slots] += 1

    def harvest(self) -> Iterator[tuple[int, list[int]]]:
        """Free the slots whose reply just ended, yielding those replies."""
        live = (self.owner >= 0).nonzero().flatten()
        last = self.replies[live, self.count[live] - 1]
        ended = live[torch.isin(last, self.stops) | (self.count[live] >= self.max_new_tokens)]
        for slot in ended.tolist():
            yield int(self.owner[slot]), self.replies[slot, : self.count[slot]].tolist()
        self.owner[ended] = -1


def slots_that_fit(model: PreTrainedModel, capacity: int, wanted: int, spare: float = CACHE_SPARE) -> int:
    """`wanted`, or on a GPU as many slots of `capacity` tokens as leave `spare` of its free memory to the forwards
    (a prefill's activations, the logits): there the preallocated cache is most of a large batch's memory (the
    float32 SmolLM2, 2,048 slots of 768 tokens: 68 GiB, against an H100's 79), and one slot too many fails the
    whole run when it is allocated."""
    if model.device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info(model.device)
    free += torch.cuda.memory_reserved(model.device) - torch.cuda.memory_allocated(model.device)  # torch's, unused
    fitting = int(free * (1 - spare)) // SlotCache.slot_bytes(model, capacity)
    if fitting < 1:
        raise ValueError(f"not one slot of {capacity} tokens fits in the GPU's free {free / 2**30:.1f} GiB; ask "
                         "for shorter prompts or fewer new tokens")
    return min(wanted, fitting)


def check_prompts(model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, slots: int) -> None:
    """Refuse input the loop cannot serve, with the reason."""
    if not prompts:
        raise ValueError("no prompts to generate replies for")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty")
    if max_new_tokens < 1 or slots < 1:
        raise ValueError(f"max_new_tokens and slots must be at least 1, got {max_new_tokens} and {slots}")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = max(map(len, prompts))
    if context and longest + max_new_tokens > context:
        raise ValueError(f"a prompt of {longest} tokens plus {max_new_tokens} new ones exceeds the model's "
                         f"context of {context} tokens")


def generate_replies(model: PreTrainedModel, prompts: list[list[int]], stops: list[int], max_new_tokens: int,
                     slots: int = 64, temperature: float = 0.0, seed: int = 0) -> Iterator[tuple[int, list[int]]]:
    """(prompt index, reply) for every prompt, in the order the replies end; greedy by default."""
    return iter(BatchGenerator(model, prompts, stops, max_new_tokens, slots, temperature, seed))
