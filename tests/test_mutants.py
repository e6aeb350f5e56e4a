"""scripts/mutants.py (not run in CI: each mutant reruns tests) stays in step with the code it breaks: every
snippet it replaces still occurs exactly once, so the next run mutates what it says it does."""
from scripts.mutants import MUTANTS, REPO, stale


def test_every_mutants_snippet_occurs_once_in_its_file():
    assert stale(REPO, MUTANTS) == []


def test_every_mutant_names_tests_that_exist_and_a_change():
    for mutant in MUTANTS:
        assert mutant.tests and all((REPO / test).is_file() for test in mutant.tests), mutant.name
        assert mutant.replacement != mutant.snippet, mutant.name
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
