"""docs/DIAGNOSIS.md opens with the verdict catalogue: the tables there are ``verdicts.markdown()``'s, so that the
doc and the code that every tool prints from say the same."""

from __future__ import annotations

from pathlib import Path

from nccl_pg.diagnostics import verdicts

DOC = Path(__file__).resolve().parent.parent / "docs" / "DIAGNOSIS.md"


def test_the_catalogue_in_the_doc_is_the_codes() -> None:
    text = DOC.read_text()
    assert verdicts.markdown() in text, "docs/DIAGNOSIS.md: paste verdicts.markdown() (python -c 'from " \
        "nccl_pg.diagnostics import verdicts; print(verdicts.markdown())')"
    assert text.index("## The verdict catalogue") < text.index("## Scenario")


def test_every_analyzer_verdict_is_answered_and_every_class_has_words() -> None:
    assert len(verdicts.ANALYZER) == 29  # NCCLAnalyzerVerdict.thrift's VerdictType, but UNKNOWN_VERDICT_TYPE
    for answer in verdicts.ANALYZER.values():
        assert answer.startswith("n/a") or all(a.split(" (")[0].strip() in verdicts.CATALOGUE
                                               for a in answer.split(";")[0].split(","))
    for c in verdicts.CATALOGUE.values():
        assert c.title and c.cause and c.next_step and set(c.tools) <= set(verdicts.TOOLS)
