"""Official EAGLE checkpoint layouts load and decode losslessly; saving round-trips; bad files are refused."""
import json
import re
import struct

import pytest
import torch
from safetensors.torch import save_file

from conftest import IdsOnlyTokenizer, tiny_base, tokens_of
from engine import Engine
from engine.draft.checkpoint import CheckpointError, load_head, save_head


def _official_eagle1(model, folder, rng):
    """Keys and config as the released EAGLE-1 (Vicuna) heads have them, built by hand."""
    c = model.config
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    w = lambda *s: torch.randn(*s, generator=rng) * 0.3
    state = {
        "embed_tokens.weight": model.get_input_embeddings().weight.clone(),
        "fc.weight": w(h, 2 * h), "fc.bias": w(h),
        "layers.0.self_attn.q_proj.weight": w(h, h), "layers.0.self_attn.k_proj.weight": w(kv, h),
        "layers.0.self_attn.v_proj.weight": w(kv, h), "layers.0.self_attn.o_proj.weight": w(h, h),
        "layers.0.mlp.gate_proj.weight": w(i, h), "layers.0.mlp.up_proj.weight": w(i, h),
        "layers.0.mlp.down_proj.weight": w(h, i), "layers.0.post_attention_layernorm.weight": 1 + w(h),
    }
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": h, "intermediate_size": i,
        "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
        "vocab_size": v, "torch_dtype": "float16", "transformers_version": "4.28.1",
    }
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(config))


def _official_eagle3(model, folder, rng, draft_vocab=12):
    c = model.config
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    w = lambda *s: torch.randn(*s, generator=rng) * 0.3
    used = torch.randperm(v, generator=rng)[:draft_vocab].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[used] = True
    state = {
        "fc.weight": w(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": w(h, 2 * h), "midlayer.self_attn.k_proj.weight": w(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, h),
        "midlayer.mlp.gate_proj.weight": w(i, h), "midlayer.mlp.up_proj.weight": w(i, h),
        "midlayer.mlp.down_proj.weight": w(h, i), "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.input_layernorm.weight": 1 + w(h), "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "norm.weight": 1 + w(h), "lm_head.weight": w(draft_vocab, h),
        "d2t": used - torch.arange(draft_vocab), "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": i,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": v, "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 2048, "pad_token_id": 0, "torch_dtype": "float16",
        "rope_theta": 500000.0,  # as the Llama-3.1 heads have it: a setting only the config carries
    }
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return used


@pytest.fixture
def model():
    return tiny_base("llama-h64-l8-gqa")


@pytest.mark.parametrize("writer", [_official_eagle1, _official_eagle3])
def test_official_layout_loads_and_decodes_losslessly(writer, model, tmp_path, prompt):
    writer(model, tmp_path / "head", torch.Generator().manual_seed(0))
    head = load_head(tmp_path / "head", model)
    engine = Engine.over(model, IdsOnlyTokenizer(), head)
    vanilla = tokens_of(engine.generate(prompt, method="vanilla", max_new_tokens=60))
    steps = list(engine.generate(prompt, method="eagle", max_new_tokens=60))
    assert tokens_of(steps) == vanilla
    assert sum(s.accepted for s in steps) > 0


def test_eagle3_vocab_map_is_applied(model, tmp_path):
    used = _official_eagle3(model, tmp_path / "head", torch.Generator().manual_seed(0))
    head = load_head(tmp_path / "head", model)
    assert head.to_target(torch.arange(len(used))).tolist() == used.tolist()


@pytest.mark.parametrize("writer", [_official_eagle1, _official_eagle3])
def test_save_then_load_round_trips_exactly(writer, model, tmp_path, prompt):
    writer(model, tmp_path / "head", torch.Generator().manual_seed(0))
    head = load_head(tmp_path / "head", model)
    save_head(head, tmp_path / "again")
    again = load_head(tmp_path / "again", model)
    saved, loaded = head.state_dict(), again.state_dict()
    assert saved.keys() == loaded.keys()
    for key, tensor in saved.items():
        assert torch.equal(tensor, loaded[key]), key
    assert json.loads((tmp_path / "again" / "config.json").read_text())["num_hidden_layers"] == 1
    weights_mode = (tmp_path / "again" / "model.safetensors").stat().st_mode & 0o777
    assert weights_mode == (tmp_path / "again" / "config.json").stat().st_mode & 0o777  # as the umask says, not 0600
    # Greedy tokens are the same for any head: what must not change is what the head computes, bit for bit, and so
    # which tokens it gets accepted.
    engine = Engine.over(model, IdsOnlyTokenizer(), head)
    _, features = engine.target.forward(torch.tensor(prompt), engine.target.new_cache())
    logits = [_draft_logits(h, features, prompt) for h in (head, again)]
    assert torch.equal(*logits), "the reloaded head computes something else"
    runs = [list(Engine.over(model, IdsOnlyTokenizer(), h).generate(prompt, method="eagle", max_new_tokens=40))
            for h in (head, again)]
    drafted = [[s.drafted for s in steps] for steps in runs]
    assert drafted[0] == drafted[1] and any(map(any, drafted[0])), "the reloaded head drafts differently"


def _draft_logits(head, features: torch.Tensor, prompt: list[int]) -> torch.Tensor:
    """The head's draft logits at every slot of the prompt (slot p: feature after token p, token p + 1)."""
    n = len(prompt)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    out, _ = head(features[None], torch.tensor([prompt[1:] + [0]]), torch.arange(n), None, causal, from_target=True)
    return head.logits(out)


def _offsets_changed(data: bytes, name: str, change) -> bytes:
    """A safetensors file's bytes with tensor `name`'s data offsets (begin, end) rewritten by `change`, the header
    kept a multiple of 8 bytes and the data left as it is: a header that lies."""
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + length])
    header[name]["data_offsets"] = list(change(*header[name]["data_offsets"], len(data)))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + length :]


TRUNCATED = r"the file is truncated: \S+ ends at byte [\d,]+, but the file holds [\d,]+"
HEAD_DAMAGES = {
    **{f"{n}-short": (lambda data, n=n: data[:-n], TRUNCATED) for n in (1, 7, 31)},
    "half": (lambda data: data[: len(data) // 2], TRUNCATED),
    "span-too-long": (lambda data: _offsets_changed(data, "norm.weight", lambda begin, end, size: (begin, end + 4)),
                      r"its header places norm\.weight at data bytes [\d,]+ to [\d,]+, but F32 \[64\] takes 256 "),
    "moved-past-end": (lambda data: _offsets_changed(data, "norm.weight",
                                                      lambda begin, end, size: (begin + size, end + size)),
                       r"the file is truncated: norm\.weight ends at byte"),
}


@pytest.mark.parametrize("damage", HEAD_DAMAGES)
def test_a_damaged_head_file_is_refused_by_name_and_what_is_wrong(model, tmp_path, damage):
    """A head file cut short, or whose header places a tensor over the wrong span or past the end: refused naming
    the file, the tensor and the fault."""
    _official_eagle3(model, tmp_path / "head", torch.Generator().manual_seed(0))
    file = tmp_path / "head" / "model.safetensors"
    cut, message = HEAD_DAMAGES[damage]
    file.write_bytes(cut(file.read_bytes()))
    with pytest.raises(CheckpointError, match=f"^cannot read {re.escape(str(file))}: {message}"):
        load_head(tmp_path / "head", model)


def test_head_for_another_base_is_refused_naming_both(model, tmp_path):
    _official_eagle1(tiny_base("llama-h48-l7-mqa"), tmp_path / "head", torch.Generator().manual_seed(0))
    with pytest.raises(CheckpointError, match=r"hidden_size 48.*does not fit base model.*hidden_size 64"):
        load_head(tmp_path / "head", model)


def test_missing_and_unexpected_keys_are_named(model, tmp_path):
    _official_eagle3(model, tmp_path / "head", torch.Generator().manual_seed(0))
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "head" / "model.safetensors"))
    state.pop("norm.weight")
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing norm\.weight.*unexpected extra\.weight"):
        load_head(tmp_path / "head", model)


def test_missing_files_and_bad_json_are_named(model, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_head(tmp_path / "empty", model)
    _official_eagle1(model, tmp_path / "head", torch.Generator().manual_seed(0))
    (tmp_path / "head" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_head(tmp_path / "head", model)


def test_a_new_eagle3_heads_config_names_the_layers_it_fuses(tmp_path):
    """As layer inputs, the field vLLM reads; loading it back fuses the same layers."""
    from engine.draft.checkpoint import new_head
    from engine.draft.eagle3 import fused_layers

    base = tiny_base("qwen2-h32-l10-tied")
    folder = save_head(new_head("eagle3", base.config), tmp_path / "head")
    config = json.loads((folder / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == fused_layers(10) == [2, 5, 7]
    assert load_head(folder, base).feature_layers(10) == [2, 5, 7]
