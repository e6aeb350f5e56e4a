"""Training-time test: the unroll's masks and shifts match inference, a head learns a known rule, resume is exact."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import Engine
from engine.draft.checkpoint import new_head, place_head
from engine.draft.drafter import Drafter
from engine.train.features import CachedFeatures, LiveFeatures, cache_features
from engine.train.fit import FitConfig, Trainer, eagle3_loss, target_rows, ttt_masks, ttt_unroll

from conftest import BRANCHING, IdsOnlyTokenizer

V, H = 32, 64


LOW = 8  # the rule runs over tokens LOW..V-1, so the draft vocabulary (those ids) needs a real d2t offset


def rule_model() -> LlamaForCausalLM:
    """A base model whose greedy next token follows a fixed rule: t -> LOW + (t - LOW + 1) mod (V - LOW).

    Its layers add nothing (zero output projections), so every hidden state is the token's embedding; the
    embeddings are orthonormal and the LM head maps embedding t onto the rule's successor of t.
    """
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    basis = torch.linalg.qr(torch.randn(H, H))[0][:V] * 4
    successor = torch.tensor([successor_of(t) for t in range(V)])
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(basis)
        model.lm_head.weight.zero_()
        model.lm_head.weight.index_add_(0, successor, basis)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.generation_config.eos_token_id = None
    return model.eval().requires_grad_(False)


def successor_of(token: int) -> int:
    return LOW + (token - LOW + 1) % (V - LOW) if token >= LOW else LOW


def rule_records(count: int, length: int = 40, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(count):
        prompt = torch.randint(LOW, V, (3,), generator=g).tolist()
        reply = [torch.randint(LOW, V, (1,), generator=g).item()]
        while len(reply) < length:
            reply.append(successor_of(reply[-1]))
        records.append({"id": str(i), "input_ids": prompt + reply, "prompt_len": len(prompt)})
    return records


def test_masks_are_causal_then_diagonal():
    masks = ttt_masks(4, 3)
    assert [tuple(m.shape) for m in masks] == [(1, 1, 4, 4), (1, 1, 4, 8), (1, 1, 4, 12)]
    causal, eye = torch.ones(4, 4).tril().bool(), torch.eye(4).bool()
    assert torch.equal(masks[2][0, 0], torch.cat([causal, eye, eye], 1))


def test_unroll_matches_the_drafters_chain_at_every_column():
    """Step s at column j must compute exactly what inference computes for a depth-s chain node after slot j."""
    model = rule_model()
    torch.manual_seed(1)
    head = new_head("eagle3", model.config, V - 4)
    head.set_vocab(torch.arange(V - 4))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head = place_head(head, model)
    record = rule_records(1, length=9)[0]
    ids = torch.tensor([record["input_ids"]])
    features = LiveFeatures(model, [record], "eagle3").batch([0])["features"]
    steps, length = 3, ids.shape[1]
    unrolled = [out[0] for out in ttt_unroll(head, features, ids, steps)]
    for j in range(length - steps):
        drafter = Drafter(head)
        drafter.commit(features[0, : j + 1], ids[0, 1 : j + 2])
        hidden = drafter._last_hidden
        assert torch.allclose(unrolled[0][j], hidden, atol=1e-5)
        for level in range(steps - 1):
            visible = torch.ones(1, level + 1, dtype=torch.bool)
            hidden = drafter.expand(hidden[None], ids[0, j + level + 2 : j + level + 3], level, visible)[0]
            assert torch.allclose(unrolled[level + 1][j], hidden, atol=1e-5), (j, level)


def test_the_alignment_mask_drops_what_follows_a_guess_outside_the_targets_top_k():
    """GRIFFIN's mask: step 1 learns only from slots whose step-0 guess was among the target's top-k; step 0 from
    all."""
    model = rule_model()
    torch.manual_seed(2)
    head = new_head("eagle3", model.config, V - LOW)
    head.set_vocab(torch.arange(LOW, V))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head = place_head(head, model)
    records = rule_records(3, length=20)
    batch = LiveFeatures(model, records, "eagle3").batch([0, 1, 2])
    rows, k = target_rows(head, model), 8
    loss = {align: eagle3_loss(head, batch, rows, 2, 0.8, align)[0] for align in (0, k, V - LOW)}
    first_step = eagle3_loss(head, batch, rows, 1, 0.8, k)[0]
    assert torch.equal(loss[V - LOW], loss[0])  # every guess is within the whole draft vocabulary's top-k
    with torch.no_grad():
        outs = [head.logits(out).float() for out in ttt_unroll(head, batch["features"], batch["input_ids"], 2)]
        target = (batch["last"] @ rows.T).float()
        aligned = (target[:, 1:-1].topk(k, -1).indices == outs[0][:, :-2].argmax(-1, keepdim=True)).any(-1)
        # slot j at step 1 predicts token j+3; its step-0 guess (token j+2) is judged where that was a reply token
        counted = batch["reply"][:, 3:] & (aligned[:, :-1] | ~batch["reply"][:, 2:-1])
        slot_loss = -(target[:, 2:-1].softmax(-1) * outs[1][:, :-3].log_softmax(-1)).sum(-1)
    assert 0 < counted.sum() < batch["reply"][:, 3:].sum()  # some slots masked, some not
    assert torch.allclose(loss[k], first_step + 0.8 * slot_loss[counted].mean(), rtol=1e-5)


def make_trainer(model, records, out, config, cached_in=None):
    torch.manual_seed(0)  # the same initial head for every trainer
    head = new_head("eagle3", model.config, V - LOW)
    head.set_vocab(torch.arange(LOW, V))
    source = (CachedFeatures(cache_features(model, records, cached_in, "eagle3"), records) if cached_in
              else LiveFeatures(model, records, "eagle3"))
    return Trainer(head, model, source, list(range(4, len(records))), list(range(4)), config, out)


def test_a_head_trained_on_a_known_rule_drafts_it_in_the_engine(tmp_path, capsys):
    model = rule_model()
    torch.manual_seed(0)
    records = rule_records(24, length=30)
    config = FitConfig(ttt_steps=3, lr=1e-2, epochs=30, batch_tokens=340, warmup=5, save_every=0, eval_every=0)
    trainer = make_trainer(model, records, tmp_path, config)
    summary = trainer.fit()
    assert min(summary["validation"]["acceptance"][:3]) > 0.9
    # into a log (not a terminal) the progress bar writes a few lines, not one redraw per step
    assert summary["steps"] > 20 and capsys.readouterr().err.count("\r") <= 4
    trainer.save_head(tmp_path / "head")
    head = place_head(trainer.unwrapped, model)
    engine = Engine.over(model, IdsOnlyTokenizer(), head)
    steps = list(engine.generate([15, 9, 11, 12], method="eagle", max_new_tokens=40, **BRANCHING))
    tokens = [t for s in steps for t in s.tokens]
    vanilla = engine.generate([15, 9, 11, 12], method="vanilla", max_new_tokens=40)
    assert tokens == [t for s in vanilla for t in s.tokens]
    assert tokens[:3] == [13, 14, 15]  # the rule
    tau = (len(tokens) - 1) / (len(steps) - 1)
    assert tau >= 4.0, f"accepted length {tau:.2f}: the head did not learn the rule through the engine"  # 4.88


def test_a_time_budget_fits_the_schedule_once_the_warm_up_is_timed_and_ends_in_it(tmp_path, monkeypatch):
    """On a clock that advances a fixed time per step, so that the verdict does not depend on the machine's speed
    or load: the pace of the warm-up sets the schedule's length, and the schedule ends within the budget."""
    model = rule_model()
    config = FitConfig(ttt_steps=2, lr=1e-3, epochs=10_000, batch_tokens=120, warmup=30, save_every=0, eval_every=0)
    trainer = make_trainer(model, rule_records(12, length=16), tmp_path, config)
    planned, lengths = trainer.total_steps, []  # (step, the schedule's length when it ran)
    now, step_s, budget_s = [0.0], 0.125, 6.0
    monkeypatch.setattr("engine.train.fit.time", SimpleNamespace(time=lambda: now[0]))
    step = trainer.train_step

    def timed_step():
        lengths.append((trainer.step, trainer.total_steps))
        loss = step()
        now[0] += step_s
        return loss

    trainer.train_step = timed_step
    summary = trainer.fit(time_limit_s=budget_s)
    assert summary["seconds"] <= budget_s and config.warmup < summary["steps"] == summary["total_steps"]
    # the schedule's length stayed as planned through the warm-up (whose rates do not depend on it) and was then
    # cut to what the budget affords, once
    assert {total for at, total in lengths if at <= config.warmup} == {planned}
    assert {total for at, total in lengths if at > config.warmup} == {summary["total_steps"]}
    assert summary["total_steps"] < planned
    # fitted to the pace of the whole warm-up, the cosine has decayed most of the way when time runs out
    assert trainer.scheduler.get_last_lr()[0] < 0.5 * config.lr


@pytest.mark.parametrize("cache", [False, True])
def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path, cache):
    model = rule_model()
    records = rule_records(12, length=16)
    config = FitConfig(ttt_steps=2, epochs=3, batch_tokens=120, warmup=2, save_every=3, eval_every=0)
    whole = make_trainer(model, records, tmp_path / "whole", config, tmp_path / "f1" if cache else None)
    whole.fit()
    interrupted = make_trainer(model, records, tmp_path / "split", config, tmp_path / "f2" if cache else None)
    interrupted.fit(max_steps=4)  # stops after step 4; the last checkpoint is at step 4 (final save)
    resumed = make_trainer(model, records, tmp_path / "split", config, tmp_path / "f2" if cache else None)
    summary = resumed.fit()
    assert summary["resumed"] and summary["steps_this_run"] == whole.step - 4
    whole_state, resumed_state = whole.unwrapped.state_dict(), resumed.unwrapped.state_dict()
    assert whole_state.keys() == resumed_state.keys()
    for name, tensor in whole_state.items():
        assert torch.equal(tensor, resumed_state[name]), name


def test_only_the_newest_two_whole_checkpoints_are_kept(tmp_path):
    """A run that saves every 3 steps keeps its last two checkpoints, and a checkpoint a save did not finish (no
    progress.json) is neither counted nor resumed from."""
    model = rule_model()
    config = FitConfig(ttt_steps=2, epochs=6, batch_tokens=120, warmup=2, save_every=3, eval_every=0)
    trainer = make_trainer(model, rule_records(12, length=16), tmp_path, config)
    trainer.fit(max_steps=10)  # saves at 3, 6 and 9, and at the end
    assert [p.name for p in trainer.whole_checkpoints()] == ["step_0000009", "step_0000010"]
    (tmp_path / "checkpoints" / "step_0000011").mkdir()  # a save killed before progress.json
    assert trainer.whole_checkpoints()[-1].name == "step_0000010"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_0000009", "step_0000010", "step_0000011"]
