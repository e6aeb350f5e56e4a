"""Tools over the library's public API: the benchmark (`python -m engine.bench`), verification cost curves and
tree tuning (`python -m engine.tools.tune_tree`). Scripts use what is exported here."""
from ..decode.costs import verification_curve
from .report import print_table, summarize
from .runs import SHARED_QUESTIONS, Run, first_turn_prompts, load_questions, run_engine, run_hf

__all__ = ["SHARED_QUESTIONS", "Run", "first_turn_prompts", "load_questions", "print_table", "run_engine", "run_hf",
           "summarize", "verification_curve"]
