"""The drafter's catch-up: a round leaves its slots to the next proposal, and once caught up the drafter's cache
holds exactly what committing the accepted text's true features from scratch builds. Feeding it the wrong tree
nodes' features, or none, only makes drafts worse, which greedy equality cannot see; this can."""
import pytest

from conftest import assert_drafter_holds, tiny_engine
from engine.draft.drafter import Drafter
from engine.decode.loop import decode
from engine.decode.params import DecodeParams
from engine.draft.tree import DynamicTree, StaticTree


@pytest.mark.parametrize("kind,tree,plain_every", [("eagle3", DynamicTree(total_tokens=16, depth=3, top_k=4), 0),
                                                   ("eagle1", StaticTree(), 3)],
                         ids=["eagle3-dynamic", "eagle1-static"])
def test_after_each_round_the_drafter_holds_the_accepted_texts_features(kind, tree, plain_every, prompt):
    engine = tiny_engine("llama-h64-l8-gqa", kind)
    drafter = Drafter(engine.head)
    text, accepted = list(prompt), 0
    params = DecodeParams(max_new_tokens=40, tree=tree, plain_every=plain_every)
    for step in decode(engine.target, drafter, prompt, params):
        if step.finish_reason:  # the last step may be cut after the drafter caught up: nothing to compare
            break
        text += step.tokens
        accepted += step.accepted
        assert drafter.length + drafter.deferred == len(text) - 1
        assert drafter.deferred == (0 if step.kind == "prefill" else len(step.tokens))  # wait for the next proposal
        drafter.catch_up()  # what that proposal does first
        assert_drafter_holds(engine, drafter, text)
    assert accepted > 3, "too few drafts accepted for the catch-up to be tested"
