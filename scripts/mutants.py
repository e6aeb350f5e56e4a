"""Break the engine on purpose, one mutant at a time, and check that the tests notice (not run in CI).

    python -m scripts.mutants              # every mutant, each stopping at the first failing test
    python -m scripts.mutants renorm --all  # the ones named, listing every test that fails
    python -m scripts.mutants wrong-features --tests tests/test_tau_regression.py   # other tests than its own
    python -m scripts.mutants --head        # on the last commit, not on the working tree
    python -m scripts.mutants --list

Each mutant is (file, exact source snippet, replacement, tests that should catch it). The working tree (tracked
files and untracked ones git does not ignore), or with --head the last commit, is copied once to a temporary
folder; each mutant is applied there alone, its tests run, the file restored. A mutant is killed when a test
fails, survived when all pass. The tests are first run unmutated, so a kill means the mutant and not a broken
test; the checkout itself is never touched. A snippet that no longer occurs exactly once stops the run before
anything runs: update it to the code.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLING = "tests/test_sampling.py"
TREE = "tests/test_tree.py"
DEEP = "tests/test_deep_trees.py"
DRAFTER = "tests/test_drafter.py"
TAU = "tests/test_tau_regression.py"
BENCH = "tests/test_bench.py"
CHECKPOINT = "tests/test_checkpoint.py"
LOSSLESS = "tests/test_lossless.py"
GATE = "tests/test_gate.py"
PREFIXES = "tests/test_prefixes.py"
QUANT = "tests/test_quant.py"
ATTENTION = "tests/test_attention.py"
METER = "tests/test_meter.py"
CORPUS = "tests/test_corpus.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    snippet: str
    replacement: str
    tests: tuple[str, ...]
    why: str


MUTANTS = [
    Mutant("renorm", "engine/decode/accept.py", "            p /= p.sum()", "            pass", (SAMPLING, DEEP),
           "no renormalisation after a rejected draft in tree speculative sampling"),
    Mutant("no-temperature", "engine/decode/accept.py",
           "        if self.temperature != 1.0:\n            procs.append(TemperatureLogitsWarper(self.temperature))\n",
           "", (SAMPLING,), "Sampling ignores the temperature"),
    Mutant("top-p-first", "engine/decode/accept.py",
           "        if self.top_k > 0:\n            procs.append(TopKLogitsWarper(self.top_k))\n"
           "        if self.top_p < 1.0:\n            procs.append(TopPLogitsWarper(self.top_p))\n",
           "        if self.top_p < 1.0:\n            procs.append(TopPLogitsWarper(self.top_p))\n"
           "        if self.top_k > 0:\n            procs.append(TopKLogitsWarper(self.top_k))\n",
           (SAMPLING,), "Sampling applies top-p before top-k"),
    Mutant("static-ranks-reversed", "engine/draft/tree.py", "tokens[index[p]] = ranks[p[-1]]",
           "tokens[index[p]] = ranks[wanted - 1 - p[-1]]", (TREE, TAU),
           "the static tree's ranks reversed (rank 0 = the worst of the ranks drafted)"),
    Mutant("wrong-features", "engine/decode/round.py",
           "path_rows(verification.features, acceptance.path)", "verification.features[: len(acceptance.path)]",
           (DRAFTER, TAU),
           "the drafter is given the features of the first tree nodes, not of the accepted path"),
    Mutant("dynamic-parent", "engine/draft/tree.py", "        parent = sel // top_k", "        parent = sel % top_k",
           (TREE, TAU), "the dynamic tree expands the wrong parent's hidden state"),
    Mutant("dynamic-parent-number", "engine/draft/tree.py", "all_parents.append(frontier.repeat_interleave(top_k))",
           "all_parents.append(frontier.repeat(top_k))", (TREE,), "the dynamic tree records the wrong parent"),
    Mutant("dynamic-keeps-worst", "engine/draft/tree.py", "torch.sort(-flat_scores, stable=True)",
           "torch.sort(flat_scores, stable=True)", (TREE,), "the dynamic tree keeps the worst-scored candidates"),
    Mutant("bonus-from-full-distribution", "engine/decode/accept.py",
           "return path, int(torch.multinomial(p, 1, generator=generator))",
           "return path, int(torch.multinomial(sampling.probs(logits[node]).cpu().double(), 1, generator=generator))",
           (SAMPLING,), "the bonus token is drawn from the whole target distribution, not the residual"),
    Mutant("tree-positions", "engine/decode/round.py", "seq.cached + tree.depths, visible",
           "seq.cached + torch.arange(len(tree)), visible", (DEEP,), "tree nodes get consecutive positions"),
    Mutant("causal-tree-mask", "engine/decode/round.py", "tree.ancestor_mask()], dim=1)",
           "torch.ones(len(tree), len(tree), dtype=torch.bool).tril()], dim=1)", (DEEP,),
           "tree nodes see every earlier node, not only their ancestors"),
    Mutant("compaction-keeps-prefix", "engine/model/cache.py", "keep = torch.tensor(path) + prefix_len",
           "keep = torch.arange(len(path)) + prefix_len", (DEEP,),
           "the cache keeps the first tree nodes instead of the accepted path"),
    Mutant("draft-level-ignored", "engine/draft/drafter.py", "positions = torch.full((b,), n + level,",
           "positions = torch.full((b,), n,", (TREE, TAU), "draft tree nodes all get the first tree position"),
    Mutant("plain-step-not-fed", "engine/decode/loop.py",
           "        drafter.commit(features, torch.tensor([seq.root]), defer=True)", "        pass", (DRAFTER,),
           "a timed plain step does not give the drafter its slot"),
    Mutant("greedy-takes-first-child", "engine/decode/accept.py",
           "match = next((c for c in kids[node] if tokens[c] == best[node]), None)",
           "match = next(iter(kids[node]), None)", (LOSSLESS,),
           "greedy verification accepts a node's first child whatever the base model's argmax"),
    Mutant("deferred-slots-dropped", "engine/draft/drafter.py",
           "        self._deferred.append((features, next_tokens))\n",
           "        if not defer:\n            self._deferred.append((features, next_tokens))\n",
           (GATE, DRAFTER),
           "slots left to the next proposal (every round's, the gate's rests, plain steps) are never caught up"),
    Mutant("gate-prefers-slower", "engine/decode/gate.py", "        faster = ratio >= 1", "        faster = ratio < 1",
           (GATE,), "the head gate gives most windows to the slower arm"),
    Mutant("adapts-despite-seed", "engine/decode/params.py", "return self.sampling.greedy or self.seed is None",
           "return True", (GATE,),
           "the head gate and the chains' sizing run for a seeded sampler, so the seed no longer repeats its answer"),
    Mutant("prefix-past-mismatch", "engine/decode/prefixes.py", "            if ours != theirs:\n                break\n",
           "            if ours != theirs:\n                continue\n", (PREFIXES,),
           "a kept prefix counts the tokens after the first difference as shared"),
    Mutant("int8-truncates", "engine/model/kernels/int8.cpp",
           "_mm256_cvttps_epi32(_mm256_round_ps(scaled, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC))",
           "_mm256_cvttps_epi32(scaled)", (QUANT,), "int8 activations truncated instead of rounded to nearest even"),
    Mutant("attention-sees-masked-keys", "engine/model/kernels/attention.cpp",
           "std::count_if(row, row + length, [](float b) { return b > -FLT_MAX; }));  // no regrowing\n"
           "    seen.bias.resize(seen.keys.size());\n    for (int64_t j = 0, n = 0; j < length; ++j)\n"
           "      if (row[j] > -FLT_MAX) seen.keys[n] = j, seen.bias[n++] = row[j];",
           "length);\n    seen.bias.resize(seen.keys.size());\n    for (int64_t j = 0, n = 0; j < length; ++j)\n"
           "      seen.keys[n] = j, seen.bias[n++] = row[j] > -FLT_MAX ? row[j] : 0.f;", (ATTENTION,),
           "the fixed-order attention lets a row see the keys its mask hides (a tree node its siblings)"),
    Mutant("meter-plain-pays-upkeep", "app/meter.py", "self.plain.add(len(step.tokens), step.wall_s - step.draft_s)",
           "self.plain.add(len(step.tokens), step.wall_s)", (METER,),
           "the meter's plain steps are timed with the drafter's upkeep, so the × shown is too high"),
    Mutant("meter-unsettled-plain-steps", "app/meter.py", "if self.plain_streak > SETTLING:",
           "if self.plain_streak > 0:", (METER,),
           "the meter times the plain steps right after drafting, before the machine settles"),
    Mutant("bench-counts-tokens", "engine/tools/runs.py", "step.tokens], wall, len(steps), steps)",
           "step.tokens], wall, sum(map(len, (s.tokens for s in steps))), steps)", (BENCH,),
           "the benchmark counts a base forward per token, not per round"),
    Mutant("saved-config-default-rope", "engine/draft/config.py", '"rope_theta": self.rope_theta,',
           '"rope_theta": 10000.0,', (CHECKPOINT,), "a saved head's config loses its rope_theta"),
    Mutant("corpus-continues-at-the-match", "engine/draft/corpus.py", "starts = [self._ends[row] + 1 for",
           "starts = [self._ends[row] for", (CORPUS,),
           "the corpus's chains start with the match's last token instead of what followed it"),
    Mutant("corpus-splits-the-end-vote", "engine/draft/corpus.py", "Counter(max(tokens[s + offset], -1) for",
           "Counter(tokens[s + offset] for", (CORPUS,),
           "replies that end after the match each vote apart, so a minority's token outvotes the end"),
]


def copy_worktree(destination: Path) -> None:
    """Tracked files and untracked ones git does not ignore, as they are in the working tree now."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def copy_head(destination: Path) -> None:
    """The files of the last commit, whatever the working tree holds now."""
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=REPO, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive.stdout, check=True)


def run_tests(root: Path, tests: tuple[str, ...], timeout: float, first_failure: bool) -> tuple[bool, list[str], float]:
    """Whether every test passed, those that did not (id and message), and the seconds it took."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *(["-x"] * first_failure),
               *tests]
    try:
        # A wide terminal, so that pytest's summary keeps each failure's message (a τ, a p-value) whole; the kernels
        # built in the copy's own folder, so a C++ mutant never replaces the build the checkout's processes load.
        env = {**os.environ, "COLUMNS": "400", "TORCH_EXTENSIONS_DIR": str(root / ".torch-extensions")}
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, ["(timed out)"], time.perf_counter() - start
    failed = [line[:240] for line in re.findall(r"^(?:FAILED|ERROR) (.+)$", done.stdout, flags=re.M)]
    if done.returncode != 0 and not failed:
        failed = [done.stdout.strip().splitlines()[-1] if done.stdout.strip() else f"exit {done.returncode}"]
    return done.returncode == 0, failed, time.perf_counter() - start


def stale(root: Path, mutants: list[Mutant]) -> list[str]:
    """Mutants whose snippet does not occur exactly once in their file."""
    return [f"{m.name}: the snippet occurs {(root / m.file).read_text().count(m.snippet)} times in {m.file}"
            for m in mutants if (root / m.file).read_text().count(m.snippet) != 1]


def apply(root: Path, mutant: Mutant) -> str:
    """Write the mutated file; returns the original text to restore."""
    path = root / mutant.file
    original = path.read_text()
    path.write_text(original.replace(mutant.snippet, mutant.replacement))
    return original


def run(root: Path, chosen: list[Mutant], every_test: bool, timeout: float) -> int:
    """The unmutated tests, then each mutant against its tests; prints one line per mutant and returns the
    number that survived (or -1 when the unmutated tests already fail)."""
    baseline = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    passed, failed, seconds = run_tests(root, baseline, timeout, first_failure=True)
    if not passed:
        print(f"the unmutated tests fail ({', '.join(failed)}): fix them first")
        return -1
    print(f"unmutated: {' '.join(baseline)} pass ({seconds:.0f} s)", flush=True)
    survived = 0
    for mutant in chosen:
        original = apply(root, mutant)
        try:
            passed, failed, seconds = run_tests(root, mutant.tests, timeout, first_failure=not every_test)
        finally:
            (root / mutant.file).write_text(original)
        survived += passed
        print(f"{'SURVIVED' if passed else 'killed  '} {mutant.name:30} {seconds:5.0f} s  {mutant.why}")
        for test in failed:
            print(f"{'':41} by {test}")
        sys.stdout.flush()
    print(f"{len(chosen) - survived} killed, {survived} survived, of {len(chosen)}")
    return survived


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.mutants", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--all", action="store_true", help="run every test of a mutant, not up to the first failure")
    parser.add_argument("--tests", nargs="+", help="run these tests (pytest ids) instead of each mutant's own")
    parser.add_argument("--head", action="store_true", help="mutate the last commit instead of the working tree")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per test run")
    args = parser.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutant {', '.join(sorted(unknown))}; see --list")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.tests:
        chosen = [replace(m, tests=tuple(args.tests)) for m in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.name:30} {m.file:26} {m.why}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as folder:
        root = Path(folder)
        (copy_head if args.head else copy_worktree)(root)
        problems = stale(root, chosen)
        if problems:
            print("\n".join(problems) + "\nupdate these snippets to the code")
            return 2
        return 0 if run(root, chosen, args.all, args.timeout) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
