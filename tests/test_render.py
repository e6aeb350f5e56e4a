"""The answer renderer: streamed detokenization, HTML escaping, Markdown and code, and per-token provenance spans."""
from __future__ import annotations

import random
import re
from html.parser import HTMLParser

import pytest

from app.render import Answer, TokenText, render_answer, render_markdown
from engine.model.load import load_tokenizer

ALLOWED_TAGS = {"div", "p", "span", "strong", "em", "code", "pre", "br", "ul", "ol", "li", "h1", "h2", "h3", "h4",
                "h5", "h6", "blockquote", "hr", "table", "thead", "tbody", "tr", "th", "td", "s", "a"}
VOID_TAGS = {"br", "hr"}
MARKDOWN_TEXT = (
    "# Title with *emphasis*\n\nSome **bold** text, `inline <code>`, a [link](https://example.com) and "
    "\\*not italic\\*.\n\n- one & two\n- 3 < 4 > 2\n\n"
    "```python\ndef f(x):\n    return x * 2  # <b>not bold</b>\n```\n\n"
    "| a | b |\n|---|---|\n| 1 | 2 |\n\n世界 🎉 done."
)


class Spans(HTMLParser):
    """Collects (classes, title, text) of every span, checks nesting, and records all tags and visible text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.spans: list[dict] = []
        self.tags: set[str] = set()
        self.text = ""
        self.outside = ""  # visible text that is in no span

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag in VOID_TAGS:
            return
        self.stack.append(tag)
        if tag == "span":
            self.spans.append({"class": dict(attrs).get("class"), "title": dict(attrs).get("title"), "text": ""})
            self.stack[-1] = ("span", len(self.spans) - 1)

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        opened = self.stack.pop()
        assert (opened[0] if isinstance(opened, tuple) else opened) == tag, f"</{tag}> closes <{opened}>"

    def handle_data(self, data):
        self.text += data
        span = next((s for s in reversed(self.stack) if isinstance(s, tuple)), None)
        if span is None:
            self.outside += data
        else:
            self.spans[span[1]]["text"] += data


def parse(html: str) -> Spans:
    parser = Spans()
    parser.feed(html)
    parser.close()
    assert not parser.stack, f"unclosed tags: {parser.stack}"
    assert parser.tags <= ALLOWED_TAGS, f"unexpected tags {parser.tags - ALLOWED_TAGS}"
    return parser


def answer_of(pieces: list[str], drafted: list[bool] | None = None) -> Answer:
    drafted = drafted if drafted is not None else [i % 3 != 2 for i in range(len(pieces))]
    from_context = [d and i % 5 == 0 for i, d in enumerate(drafted)]
    return Answer(ids=list(range(len(pieces))), pieces=list(pieces), drafted=drafted, from_context=from_context)


def subsequence(part: str, whole: str) -> bool:
    """Rendering only drops characters (Markdown syntax, escapes), so a span shows a subsequence of its token."""
    rest = iter(whole)
    return all(char in rest for char in part)


def check_accounting(answer: Answer) -> Spans:
    """Every token has span(s) of exactly one class, matching its provenance; all visible text is in spans."""
    page = parse(render_answer(answer))
    classes: dict[int, set[str]] = {}
    for span in page.spans:
        token = int(re.fullmatch(r"token (\d+)", span["title"]).group(1))
        classes.setdefault(token, set()).add(span["class"])
        assert subsequence(span["text"], answer.pieces[token]), (span, answer.pieces[token])
    assert sorted(classes) == list(range(len(answer.pieces))), "some token has no span"
    for token, kinds in classes.items():
        assert kinds == {answer.kind(token)}, (token, kinds)
    assert not page.outside.strip(), f"text outside any span: {page.outside!r}"
    plain = parse(render_answer(answer, provenance=False))
    assert page.text == plain.text and not plain.spans
    return page


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def stream(tokenizer, text: str, drafted=None) -> Answer:
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    flags = drafted or [random.Random(0).random() < 0.6 for _ in ids]
    answer, detokenizer = Answer(), TokenText(tokenizer)
    for i in range(0, len(ids), 3):  # three tokens a round, as a decoding loop delivers them
        answer.add(ids[i : i + 3], flags[i : i + 3], detokenizer)
    answer.finish(detokenizer)
    return answer


def test_detokenizer_gives_one_piece_per_token_and_holds_back_split_characters(tokenizer):
    answer = stream(tokenizer, "ünïcödé 日本語 🎉 and ascii")
    assert len(answer.pieces) == len(answer.ids)
    assert answer.text == tokenizer.decode(answer.ids, skip_special_tokens=True)
    assert "\ufffd" not in answer.text
    assert answer.pieces[-1] == ""  # the stop token shows nothing
    # Some tokens hold only part of a character: their piece is empty and a later token completes it.
    single = [tokenizer.decode([i]) for i in answer.ids]
    split = [i for i, text in enumerate(single) if "\ufffd" in text]
    assert split and any(answer.pieces[i] == "" for i in split)
    check_accounting(answer)


def test_unfinished_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("🎉")[:-1]
    detokenizer = TokenText(tokenizer)
    assert [detokenizer.add(i) for i in ids] == [""] * len(ids)
    assert detokenizer.flush() == "\ufffd"


def test_script_ampersand_and_quotes_are_escaped():
    answer = answer_of(["Hi ", "<scr", "ipt>alert('x')</", "script>", " & ", "<img src=x onerror=alert(1)>", ' "q"'])
    html = render_answer(answer)
    assert "<script" not in html and "<img" not in html and "&lt;scr" in html and "&amp;" in html
    page = check_accounting(answer)
    assert "<script>alert('x')</script>" in page.text and "<img src=x onerror=alert(1)>" in page.text


def test_markdown_specials_split_across_tokens_keep_markup_well_formed():
    pieces = ["**", "bo", "ld**", " and _", "it_ ", "[x](", "javascript:alert(1))", " \\*", "lit\\*", " a|b ~~", "s~~"]
    answer = answer_of(pieces)
    page = check_accounting(answer)
    html = render_answer(answer)
    assert "<strong>" in html and "<em>" in html and "<s>" in html
    assert "<a " not in html, "a javascript: link must stay text"
    assert "*lit*" in page.text and "a|b" in page.text
    assert "**" not in page.text


def test_fenced_code_split_across_tokens_renders_as_code_with_spans_inside():
    pieces = ["Here:\n\n``", "`py", "thon\n", "if a < b", " and c:\n", "    print('<b>')", "\n```", "\nDone."]
    answer = answer_of(pieces)
    html = render_answer(answer)
    page = check_accounting(answer)
    code = re.search(r'<pre><code class="language-python">(.*?)</code></pre>', html, re.S)
    assert code, html
    inner = parse(code.group(1))
    assert inner.text == "if a < b and c:\n    print('<b>')\n"
    assert {s["class"] for s in inner.spans} == {"drafted", "base"}
    assert page.text.strip().endswith("Done.")


def test_unclosed_fence_while_streaming_is_still_code():
    html = render_answer(answer_of(["```", "js\n", "let x = 1 <", " 2;"]))
    assert "<pre><code" in html and "</code></pre>" in html


def test_markdown_document_streamed_from_real_tokens(tokenizer):
    answer = stream(tokenizer, MARKDOWN_TEXT)
    page = check_accounting(answer)
    html = render_answer(answer)
    for tag in ("h1", "em", "strong", "code", "pre", "li", "table", "a"):
        assert tag in page.tags, tag
    assert "<b>" not in html and "&lt;b&gt;not bold&lt;/b&gt;" in render_answer(answer, provenance=False)
    assert "世界 🎉 done." in page.text
    drafted = {int(s["title"].split()[1]) for s in page.spans if s["class"] == "drafted"}
    assert len(drafted) == sum(answer.drafted)


def test_every_prefix_of_a_stream_renders_well_formed(tokenizer):
    """Each round re-renders a partial answer: no prefix may break the markup or lose a token."""
    full = stream(tokenizer, MARKDOWN_TEXT)
    for n in range(1, len(full.ids) + 1, 2):
        check_accounting(answer_of(full.pieces[:n], full.drafted[:n]))


def test_context_drafted_tokens_get_their_own_class(tokenizer):
    ids = tokenizer.encode("Copy: alpha beta gamma. Copy: alpha beta gamma.")
    drafted = [i % 2 == 1 for i in range(len(ids))]
    from_context = [d and i > len(ids) // 2 for i, d in enumerate(drafted)]
    answer, detokenizer = Answer(), TokenText(tokenizer)
    answer.add(ids, drafted, detokenizer, from_context)
    answer.finish(detokenizer)
    page = check_accounting(answer)
    kinds = {int(s["title"].split()[1]): s["class"] for s in page.spans}
    assert {t for t, k in kinds.items() if k == "context"} == {i for i, c in enumerate(from_context) if c} != set()
    assert {t for t, k in kinds.items() if k == "drafted"} == {
        i for i, d in enumerate(drafted) if d and not from_context[i]}
    with pytest.raises(ValueError):  # one flag per token, as for drafted
        Answer().add(ids[:2], [True, True], TokenText(tokenizer), [True])


def test_user_messages_are_escaped_markdown():
    html = render_markdown("<b>hi</b> & **there**")
    assert "<b>" not in html and "&lt;b&gt;" in html and "&amp;" in html and "<strong>there</strong>" in html
    assert "<span" not in html
