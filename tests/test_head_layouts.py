"""Published EAGLE head layouts load into the same head modules as the official layout: SpecForge / SGLang EAGLE-3,
vLLM speculators EAGLE-3 and EAGLE-1, heads over the target's own vocabulary and heads with their own embeddings.
Each drafts what the same weights draft in the official layout, decodes losslessly, and a bad file is refused by
name. Every checkpoint here is written by hand as its project writes it, from random weights at tiny shapes."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import BRANCHING, IdsOnlyTokenizer, tiny_base, tokens_of
from engine import Engine
from engine.draft.checkpoint import CheckpointError, load_head, save_head
from engine.model.target import Target

BASE = "llama-h64-l8-gqa"  # 8 layers: the official capture fuses the inputs of layers 2, 4 and 5
DRAFT_VOCAB = 12
SPECFORGE_IDS = [0, 3, 5]  # SpecForge numbers layer outputs: the inputs of layers 1, 4 and 6
SPECULATORS_IDS = [1, 4, 6]  # speculators and vLLM number layer inputs
INPUTS = [1, 4, 6]


@pytest.fixture
def model():
    return tiny_base(BASE)


# ---- weights in the official names, and each project's way of writing them ----------------------------------------


def _eagle3_weights(model, seed: int = 0, draft_vocab: int | None = DRAFT_VOCAB, fused: int = 3,
                    head_dim: int | None = None, own_embeddings: bool = False) -> dict[str, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    c = model.config
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    hd = head_dim or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    w = lambda *s: torch.randn(*s, generator=rng) * 0.3
    state = {
        "fc.weight": w(h, fused * h),
        "midlayer.self_attn.q_proj.weight": w(q, 2 * h), "midlayer.self_attn.k_proj.weight": w(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, q),
        "midlayer.mlp.gate_proj.weight": w(i, h), "midlayer.mlp.up_proj.weight": w(i, h),
        "midlayer.mlp.down_proj.weight": w(h, i), "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.input_layernorm.weight": 1 + w(h), "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "norm.weight": 1 + w(h), "lm_head.weight": w(draft_vocab or v, h),
    }
    if draft_vocab and draft_vocab < v:
        used = torch.randperm(v, generator=rng)[:draft_vocab].sort().values
        state["d2t"] = used - torch.arange(draft_vocab)
        state["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, used, True)
    if own_embeddings:
        state["embed_tokens.weight"] = w(v, h)
    return state


def _eagle1_weights(model, seed: int = 0) -> dict[str, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    c = model.config
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    w = lambda *s: torch.randn(*s, generator=rng) * 0.3
    return {
        "fc.weight": w(h, 2 * h), "fc.bias": w(h),
        "layers.0.self_attn.q_proj.weight": w(h, h), "layers.0.self_attn.k_proj.weight": w(kv, h),
        "layers.0.self_attn.v_proj.weight": w(kv, h), "layers.0.self_attn.o_proj.weight": w(h, h),
        "layers.0.mlp.gate_proj.weight": w(i, h), "layers.0.mlp.up_proj.weight": w(i, h),
        "layers.0.mlp.down_proj.weight": w(h, i), "layers.0.post_attention_layernorm.weight": 1 + w(h),
    }


def _llama_fields(model, head_dim: int | None = None) -> dict:
    """The decoder layer's Llama fields; rope_theta and rms_norm_eps off their defaults, so reading them counts."""
    c = model.config
    fields = {
        "hidden_act": "silu", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "vocab_size": c.vocab_size, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048,
    }
    if head_dim:
        fields["head_dim"] = head_dim
    return fields


def _write(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _rename(state: dict[str, torch.Tensor], ours: str, theirs: str) -> dict[str, torch.Tensor]:
    return {(theirs + k.removeprefix(ours) if k.startswith(ours) else k): v for k, v in state.items()}


def write_official(folder, model, state, kind="eagle3", head_dim=None, **extra) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_llama_fields(model, head_dim),
              "num_hidden_layers": 1, "torch_dtype": "float16", **extra}
    if kind == "eagle3" and "lm_head.weight" in state and "draft_vocab_size" not in extra:
        config["draft_vocab_size"] = state["lm_head.weight"].shape[0]
    return _write(folder, config, state)


def write_specforge(folder, model, state, layer_ids=SPECFORGE_IDS, head_dim=None, **extra) -> Path:
    """As SpecForge exports a head (and SGLang's LlamaForCausalLMEagle3 loads it): the official tensor names with a
    copy of the target's embedding, d2t and t2d always saved, the fused layers under eagle_config."""
    state = dict(state)
    v = model.config.vocab_size
    rows = state["lm_head.weight"].shape[0]
    state.setdefault("embed_tokens.weight", model.get_input_embeddings().weight.detach().clone())
    state.setdefault("d2t", torch.zeros(rows, dtype=torch.long))
    state.setdefault("t2d", torch.ones(v, dtype=torch.bool))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **_llama_fields(model, head_dim),
              "num_hidden_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
              "draft_vocab_size": rows, **extra}
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    return _write(folder, config, state)


def _speculators_config(model_type: str, algorithm: str) -> dict:
    return {
        "speculators_model_type": model_type, "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny-llama"},
        },
    }


def write_speculators3(folder, model, state, layer_ids=SPECULATORS_IDS, norm_before_residual=False,
                       layer=None, **extra) -> Path:
    """As speculators saves an Eagle3Speculator (and vLLM reads it): midlayer.* as layers.0.*, the decoder layer's
    Llama config nested, the head's own fields on top."""
    state = _rename(state, "midlayer.", "layers.0.")
    v = model.config.vocab_size
    state.setdefault("embed_tokens.weight", model.get_input_embeddings().weight.detach().clone())
    config = {
        "architectures": ["Eagle3Speculator"], **_speculators_config("eagle3", "eagle3"),
        "transformer_layer_config": {"model_type": "llama", **_llama_fields(model), "num_hidden_layers": 1,
                                     "attention_bias": False, "mlp_bias": False,
                                     "head_dim": model.config.hidden_size // model.config.num_attention_heads,
                                     **(layer or {})},
        "draft_vocab_size": state["lm_head.weight"].shape[0] if "lm_head.weight" in state else v,
        "norm_before_residual": norm_before_residual, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": layer_ids, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False, "torch_dtype": "float32", **extra,
    }
    return _write(folder, config, state)


def write_speculators1(folder, model, state, **extra) -> Path:
    """As speculators saved an EagleSpeculator (EAGLE-1 / HASS): fc as fusion_fc, layers.0 as transformer, no
    embedding or LM head (the verifier's), the verifier's whole config as transformer_layer_config."""
    state = _rename(_rename(state, "fc.", "fusion_fc."), "layers.0.", "transformer.")
    config = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"], **_speculators_config("eagle", "eagle"),
        "transformer_layer_architecture": "LlamaDecoderLayer", "layernorms": False, "fusion_bias": True,
        "transformer_layer_config": {"model_type": "llama", **_llama_fields(model),
                                     "num_hidden_layers": model.config.num_hidden_layers},
        **extra,
    }
    return _write(folder, config, state)


# ---- what a head computes ------------------------------------------------------------------------------------------


def _draft_logits(head, features: torch.Tensor, prompt: list[int]) -> torch.Tensor:
    """The head's draft logits at every slot of the prompt (slot p: feature after token p, token p + 1)."""
    n = len(prompt)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    out, _ = head(features[None], torch.tensor([prompt[1:] + [0]]), torch.arange(n), None, causal, from_target=True)
    return head.logits(out)[0]


def _features(head, seed: int, n: int) -> torch.Tensor:
    """Random target features of the head's width for n slots: the layers compared here do not depend on them."""
    return torch.randn(n, head.config.feature_size, generator=torch.Generator().manual_seed(seed))


def _reference_eagle3_logits(state: dict[str, torch.Tensor], features: torch.Tensor, prompt: list[int],
                             embed: torch.Tensor, config: dict, norm_before_residual: bool) -> torch.Tensor:
    """One causal EAGLE-3 pass written op by op from SpecForge's LlamaDecoderLayer and speculators'
    Eagle3FirstLayerMixin: fc, cat([norm(embedding), norm(hidden)]), rotate-half RoPE, GQA attention, residual (the
    raw hidden, or the normed one with norm_before_residual), SwiGLU MLP, final norm, LM head."""
    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    n = len(prompt)
    w = lambda name: state[f"midlayer.{name}.weight"]
    rms = lambda x, weight: weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    hidden = features @ state["fc.weight"].T
    normed = rms(hidden, w("hidden_norm"))
    x = torch.cat([rms(embed[torch.tensor(prompt[1:] + [0])], w("input_layernorm")), normed], dim=-1)
    q = (x @ w("self_attn.q_proj").T).view(n, heads, head_dim).transpose(0, 1)
    k = (x @ w("self_attn.k_proj").T).view(n, kv_heads, head_dim).transpose(0, 1)
    v = (x @ w("self_attn.v_proj").T).view(n, kv_heads, head_dim).transpose(0, 1)
    inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(n).float()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotate = lambda t: t * cos + torch.cat([-t[..., head_dim // 2:], t[..., : head_dim // 2]], -1) * sin
    q, k = rotate(q), rotate(k)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (k, v))
    scores = (q @ k.transpose(1, 2)) / head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * head_dim)
    after = (normed if norm_before_residual else hidden) + attended @ w("self_attn.o_proj").T
    mlp_in = rms(after, w("post_attention_layernorm"))
    gated = torch.nn.functional.silu(mlp_in @ w("mlp.gate_proj").T) * (mlp_in @ w("mlp.up_proj").T)
    out = after + gated @ w("mlp.down_proj").T
    return rms(out, state["norm.weight"]) @ state["lm_head.weight"].T


# ---- each layout loads and drafts what the official layout drafts ----------------------------------------------------

# name: (write the layout, write the same weights in the official layout, layout, fused layers on an 8-layer base)
CASES = {
    "specforge": (
        lambda f, m, s: write_specforge(f, m, s),
        lambda f, m, s: write_official(f, m, s, eagle_aux_hidden_state_layer_ids=INPUTS),
        "specforge", INPUTS),
    "speculators-eagle3": (
        lambda f, m, s: write_speculators3(f, m, s),
        lambda f, m, s: write_official(f, m, s, eagle_aux_hidden_state_layer_ids=INPUTS),
        "speculators", INPUTS),
    "specforge-default-layers": (
        lambda f, m, s: write_specforge(f, m, s, layer_ids=None),
        lambda f, m, s: write_official(f, m, s),
        "specforge", [2, 4, 5]),
    "speculators-default-layers": (
        lambda f, m, s: write_speculators3(f, m, s, layer_ids=None),
        lambda f, m, s: write_official(f, m, s),
        "speculators", [2, 4, 5]),
}


@pytest.mark.parametrize("case", CASES)
def test_eagle3_layouts_draft_what_the_official_layout_drafts(case, model, tmp_path, prompt):
    write, write_twin, layout, layers = CASES[case]
    state = _eagle3_weights(model)
    head = load_head(write(tmp_path / "head", model, state), model)
    twin = load_head(write_twin(tmp_path / "twin", model, state), model)
    assert (head.layout, twin.layout) == (layout, "official")
    assert head.feature_layers(8) == twin.feature_layers(8) == layers
    features = _features(head, 0, len(prompt))
    assert torch.equal(_draft_logits(head, features, prompt), _draft_logits(twin, features, prompt))
    draft_ids = torch.arange(DRAFT_VOCAB)
    assert torch.equal(head.to_target(draft_ids), twin.to_target(draft_ids))
    assert head.to_target(draft_ids).tolist() == (torch.arange(DRAFT_VOCAB) + state["d2t"]).tolist()


def test_speculators_eagle1_drafts_what_the_official_eagle1_drafts(model, tmp_path, prompt):
    state = _eagle1_weights(model)
    head = load_head(write_speculators1(tmp_path / "head", model, state), model)
    twin = load_head(write_official(tmp_path / "twin", model, state, kind="eagle1", bias=True), model)
    assert (head.kind, head.layout, head.embed_tokens) == ("eagle1", "speculators", None)
    assert head.feature_layers(8) is None and len(head.layers) == 1  # one layer, whatever the verifier has
    features = _features(head, 1, len(prompt))
    assert torch.equal(_draft_logits(head, features, prompt), _draft_logits(twin, features, prompt))


@pytest.mark.parametrize("layout, norm_before_residual, head_dim", [
    ("speculators", False, None), ("speculators", True, None), ("specforge", False, 32)])
def test_eagle3_layers_compute_what_their_projects_code_computes(layout, norm_before_residual, head_dim, model,
                                                                 tmp_path, prompt):
    """Against a reference written from the projects' modelling code: the residual choice and heads wider than
    hidden / heads (SpecForge's gpt-oss configs) change the math; the head must follow."""
    state = _eagle3_weights(model, seed=2, head_dim=head_dim)
    if layout == "specforge":
        folder = write_specforge(tmp_path / "head", model, state, head_dim=head_dim)
    else:
        folder = write_speculators3(tmp_path / "head", model, state, norm_before_residual=norm_before_residual)
    head = load_head(folder, model)
    features = _features(head, 2, len(prompt))
    embed = model.get_input_embeddings().weight
    expected = _reference_eagle3_logits(state, features, prompt, embed, _llama_fields(model, head_dim),
                                        norm_before_residual)
    torch.testing.assert_close(_draft_logits(head, features, prompt), expected, rtol=1e-5, atol=1e-5)


def test_a_target_vocabulary_head_loads_without_a_vocab_map(model, tmp_path, prompt):
    """Official without draft_vocab_size or d2t/t2d; SpecForge with draft_vocab_size = vocab_size and the identity
    d2t/t2d it always saves: both draft over the base vocabulary with ids unchanged."""
    state = _eagle3_weights(model, draft_vocab=None)
    vocab = model.config.vocab_size
    bare = load_head(_without_draft_vocab_size(write_official(tmp_path / "bare", model, state)), model)
    assert "draft_vocab_size" not in json.loads((tmp_path / "bare" / "config.json").read_text())
    specforge = load_head(write_specforge(tmp_path / "specforge", model, state), model)
    twin = load_head(write_official(tmp_path / "twin", model, state), model)
    features = _features(twin, 3, len(prompt))
    for head in (bare, specforge):
        assert not head.has_vocab_map and head.config.draft_vocab == vocab
        assert head.to_target(torch.arange(vocab)).tolist() == list(range(vocab))
        assert torch.equal(_draft_logits(head, features, prompt), _draft_logits(twin, features, prompt))


def _without_draft_vocab_size(folder: Path) -> Path:
    return _edit(folder, config={"draft_vocab_size": None})


def test_a_head_with_its_own_embeddings_embeds_with_them(model, tmp_path, prompt):
    state = _eagle3_weights(model, own_embeddings=True)
    borrowed = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
    heads = [load_head(write(tmp_path / name, model, state), model)
             for name, write in (("official", write_official), ("speculators", write_speculators3))]
    plain = load_head(write_official(tmp_path / "borrowing", model, borrowed), model)
    tokens = torch.arange(model.config.vocab_size)
    features = _features(plain, 4, len(prompt))
    for head in heads:
        assert torch.equal(head.embed(tokens), state["embed_tokens.weight"])
        assert not torch.equal(head.embed(tokens), model.get_input_embeddings().weight)
        assert torch.equal(_draft_logits(head, features, prompt), _draft_logits(heads[0], features, prompt))
    assert not torch.equal(_draft_logits(plain, features, prompt), _draft_logits(heads[0], features, prompt))


def test_fused_layers_are_the_ones_each_project_captures(model, tmp_path, prompt):
    """SpecForge's id j is the output of layer j (hidden_states[j + 1] in transformers' numbering), speculators' id j
    the input of layer j (hidden_states[j]): both name the same three layers here, and the engine captures those."""
    state = _eagle3_weights(model)
    with torch.inference_mode():
        hidden_states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for write, ids, shift in ((write_specforge, SPECFORGE_IDS, 1), (write_speculators3, SPECULATORS_IDS, 0)):
        head = load_head(write(tmp_path / write.__name__, model, state), model)
        target = Target(model, head.feature_layers(model.config.num_hidden_layers), fused=False)
        _, features = target.forward(torch.tensor(prompt), target.new_cache())
        expected = torch.cat([hidden_states[j + shift][0] for j in ids], dim=-1)
        torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)


WRITERS = {
    "specforge": lambda f, m: write_specforge(f, m, _eagle3_weights(m)),
    "speculators-eagle3": lambda f, m: write_speculators3(f, m, _eagle3_weights(m), norm_before_residual=True),
    "speculators-eagle1": lambda f, m: write_speculators1(f, m, _eagle1_weights(m, seed=1)),
    "target-vocabulary": lambda f, m: _without_draft_vocab_size(
        write_official(f, m, _eagle3_weights(m, draft_vocab=None))),
    "own-embeddings": lambda f, m: write_official(f, m, _eagle3_weights(m, own_embeddings=True)),
}


@pytest.mark.parametrize("layout", WRITERS)
def test_greedy_eagle_with_each_layout_equals_plain_decoding(layout, model, tmp_path, prompt):
    head = load_head(WRITERS[layout](tmp_path / "head", model), model)
    engine = Engine.over(model, IdsOnlyTokenizer(), head)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=40))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=40, **BRANCHING))
    assert tokens_of(steps) == vanilla
    assert sum(s.accepted for s in steps) > 0  # drafts were taken: the head's tokens reached the output


def test_a_saved_head_reloads_with_its_layers_and_residual(model, tmp_path, prompt):
    """save_head writes the official layout; what the other layout's config said must survive it."""
    head = load_head(write_speculators3(tmp_path / "head", model, _eagle3_weights(model), norm_before_residual=True),
                     model)
    again = load_head(save_head(head, tmp_path / "again"), model)
    assert (again.layout, again.feature_layers(8), again.config.norm_before_residual) == ("official", INPUTS, True)
    features = _features(head, 5, len(prompt))
    assert torch.equal(_draft_logits(head, features, prompt), _draft_logits(again, features, prompt))


# ---- bad files are refused by name ---------------------------------------------------------------------------------


def _edit(folder: Path, config=None, drop=(), add=None, replace=None) -> Path:
    """Change a written checkpoint: config fields (None deletes), tensors dropped, added or replaced."""
    if config:
        raw = json.loads((folder / "config.json").read_text())
        for key, value in config.items():
            target, _, leaf = key.rpartition(".")
            where = raw[target] if target else raw
            where.pop(leaf, None) if value is None else where.__setitem__(leaf, value)
        (folder / "config.json").write_text(json.dumps(raw))
    if drop or add or replace:
        state = load_file(str(folder / "model.safetensors"))
        state = {k: v for k, v in state.items() if k not in drop} | (add or {}) | (replace or {})
        save_file(state, str(folder / "model.safetensors"))
    return folder


def test_a_head_fusing_four_layers_without_naming_them_is_refused(model, tmp_path):
    state = _eagle3_weights(model, fused=4)
    folder = write_speculators3(tmp_path / "speculators", model, state, layer_ids=None)
    with pytest.raises(CheckpointError, match=r"config\.json: fc\.weight fuses 4 target layers but "
                                              r"eagle_aux_hidden_state_layer_ids is absent"):
        load_head(folder, model)
    folder = write_specforge(tmp_path / "specforge", model, state, layer_ids=None)
    with pytest.raises(CheckpointError,
                       match=r"config\.json: .*eagle_config\.eagle_aux_hidden_state_layer_ids is absent"):
        load_head(folder, model)
    named = load_head(write_speculators3(tmp_path / "named", model, state, layer_ids=[1, 3, 5, 6]), model)
    assert named.feature_layers(8) == [1, 3, 5, 6] and named.config.feature_size == 4 * 64


@pytest.mark.parametrize("field, message", [
    ("norm_before_residual", r"config\.json: lacks norm_before_residual"),
    ("transformer_layer_config.hidden_size", r"config\.json: lacks transformer_layer_config\.hidden_size"),
    ("transformer_layer_config.model_type", r"config\.json: lacks transformer_layer_config\.model_type"),
    ("transformer_layer_config", r"config\.json: lacks transformer_layer_config"),
    ("speculators_model_type", r"config\.json: lacks speculators_model_type"),
])
def test_a_speculators_config_missing_a_field_names_file_and_field(field, message, model, tmp_path):
    folder = _edit(write_speculators3(tmp_path / "head", model, _eagle3_weights(model)), config={field: None})
    with pytest.raises(CheckpointError, match=message):
        load_head(folder, model)


@pytest.mark.parametrize("write", [write_specforge, write_speculators3])
def test_a_head_for_another_base_is_refused_naming_both(write, model, tmp_path):
    other = tiny_base("llama-h48-l7-mqa")
    folder = write(tmp_path / "head", other, _eagle3_weights(other), layer_ids=[1, 2, 3])
    with pytest.raises(CheckpointError, match=r"hidden_size 48.*does not fit base model.*hidden_size 64"):
        load_head(folder, model)


def test_fused_layers_past_the_base_are_refused(model, tmp_path):
    folder = write_speculators3(tmp_path / "head", model, _eagle3_weights(model), layer_ids=[1, 4, 8])
    with pytest.raises(CheckpointError, match=r"fused target layers \[1, 4, 8\].*more than 8 layers, it has 8"):
        load_head(folder, model)
    folder = write_specforge(tmp_path / "specforge", model, _eagle3_weights(model), layer_ids=[1, 4, 7])
    with pytest.raises(CheckpointError, match=r"fused target layers \[2, 5, 8\]"):  # output of 7: input of 8
        load_head(folder, model)


@pytest.mark.parametrize("write, edit, message", [
    (write_speculators3, dict(drop=["layers.0.hidden_norm.weight"]), r"missing layers\.0\.hidden_norm\.weight"),
    (write_speculators1, dict(drop=["fusion_fc.bias"]), r"missing fusion_fc\.bias"),
    (write_specforge, dict(add={"fc_norm.0.weight": torch.ones(64)}), r"unexpected fc_norm\.0\.weight"),
    (write_speculators3, dict(add={"layers.1.mlp.up_proj.weight": torch.ones(2, 2)}),
     r"unexpected layers\.1\.mlp\.up_proj\.weight"),
    (write_speculators3, dict(replace={"layers.0.self_attn.q_proj.weight": torch.ones(64, 64)}),
     r"layers\.0\.self_attn\.q_proj\.weight has shape \[64, 64\], config\.json implies \[64, 128\]"),
    (write_specforge, dict(replace={"lm_head.weight": torch.ones(10, 64)}),
     r"lm_head\.weight has shape \[10, 64\], config\.json implies \[12, 64\]"),
])
def test_missing_unexpected_and_misshaped_tensors_are_named_as_the_file_names_them(write, edit, message, model,
                                                                                  tmp_path):
    weights = _eagle1_weights(model) if write is write_speculators1 else _eagle3_weights(model)
    folder = _edit(write(tmp_path / "head", model, weights), **edit)
    with pytest.raises(CheckpointError, match=message):
        load_head(folder, model)


@pytest.mark.parametrize("write, config, message", [
    (write_specforge, {"fc_norm": True}, r"fc_norm is true: an RMSNorm on each fused layer"),
    (write_specforge, {"norm_output": False}, r"norm_output is false"),
    (write_specforge, {"num_hidden_layers": 2}, r"num_hidden_layers is 2: only one-layer EAGLE-3 heads"),
    (write_speculators3, {"norm_output": True}, r"norm_output is true"),
    (write_speculators3, {"norm_before_fc": True}, r"norm_before_fc is true"),
    (write_speculators3, {"transformer_layer_config.model_type": "qwen3"}, r"model_type is 'qwen3'"),
    (write_speculators3, {"transformer_layer_config.attention_bias": True},
     r"transformer_layer_config\.attention_bias is true"),
    (write_speculators3, {"speculators_model_type": "mtp"}, r"speculators_model_type is 'mtp'"),
    (write_speculators1, {"layernorms": True}, r"layernorms is true"),
])
def test_settings_the_head_does_not_compute_are_refused_by_name(write, config, message, model, tmp_path):
    weights = _eagle1_weights(model) if write is write_speculators1 else _eagle3_weights(model)
    folder = _edit(write(tmp_path / "head", model, weights), config=config)
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + message):
        load_head(folder, model)
