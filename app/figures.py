"""A finished answer's figures in words: one line under the reply in the page and in the Markdown export. Plain
values in, text out (no engine here), so the chat store exports without loading a model, whatever an imported file
holds."""
from __future__ import annotations

METHOD_NAMES = {"eagle": "EAGLE", "suffix": "Context drafting (no head)", "vanilla": "Plain decoding"}
FINISH_NAMES = {"eos": "finished", "length": "token limit reached", "context": "context full"}


def _number(value: object, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


FIGURES = (  # (keys, words): figures shown in this order, a pair together where both are there
    (("method",), lambda method: METHOD_NAMES.get(method, str(method))),
    (("model", "head"), lambda model, head: f"{model} + {head}"),
    (("model",), str),
    (("head",), lambda head: f"head {head}"),
    (("tokens",), lambda tokens: f"{tokens} tokens"),
    (("tokens_per_s",), lambda rate: f"{_number(rate, 1)} tokens/s"),
    (("tau",), lambda tau: f"τ {_number(tau, 2)}"),
    (("accepted", "drafted"), lambda accepted, drafted: f"{accepted} of {drafted} drafted tokens accepted"),
    (("accepted",), lambda accepted: f"{accepted} drafted tokens accepted"),
    (("drafted",), lambda drafted: f"{drafted} drafted tokens"),
    (("speedup",), lambda speedup: f"{_number(speedup, 2)}× plain decoding"),
    (("ttft_s",), lambda seconds: f"first token {_number(seconds, 2)} s"),
    (("finish",), lambda finish: FINISH_NAMES.get(finish, str(finish))),
)


def figures_line(figures: dict) -> str:
    """E.g. "EAGLE · smollm2 + smollm2-135m-eagle3 · 120 tokens · 150.2 tokens/s · τ 1.80 · 50 of 90 drafted
    tokens accepted · 1.12× plain decoding · first token 0.11 s · finished": the known figures in that order, any
    others as `key: value`, a missing one left out."""
    left = {key: value for key, value in figures.items() if value is not None}
    parts = []
    for keys, words in FIGURES:
        if all(key in left for key in keys):
            parts.append(words(*(left.pop(key) for key in keys)))
    return " · ".join(parts + [f"{key}: {value}" for key, value in left.items()])
