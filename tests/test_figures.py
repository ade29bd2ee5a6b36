"""The quoted figures of the README and the docs equal their result files (`studies.figures`)."""

import os

import pytest

from studies import figures


@pytest.mark.parametrize("quote", figures.QUOTES, ids=lambda q: f"{q.doc}:{q.text[:40]}")
def test_a_quoted_figure_reads_as_its_result_file_says(quote):
  with open(os.path.join(figures.ROOT, quote.doc)) as f:
    doc = figures.normalized(f.read())
  expected = figures.normalized(quote.expected())
  assert expected in doc, (f"{quote.doc} should read {expected!r} ({quote.source}); "
                           "rerun changed a number: update the text, or the quote")


def test_a_quote_that_no_longer_matches_is_caught(tmp_path):
  """A rerun that moves the numbers (dense's times x 1.5 in a copy of the MLP's result file)
  formats a quote the README does not hold."""
  import json
  quote = next(q for q in figures.QUOTES if q.source.endswith("/time_to_accuracy.json")
               and "sooner than sparsejax dense" in q.text)
  results = quote.load()
  for link, times in results["analysis"]["dense"]["predicted_time_to_target_s"].items():
    results["analysis"]["dense"]["predicted_time_to_target_s"][link] = [t * 1.5 for t in times]
  (tmp_path / os.path.dirname(quote.source)).mkdir(parents=True)
  (tmp_path / quote.source).write_text(json.dumps(results))
  with open(os.path.join(figures.ROOT, quote.doc)) as f:
    doc = figures.normalized(f.read())
  assert figures.normalized(quote.expected()) in doc
  assert figures.normalized(quote.expected(str(tmp_path))) not in doc


def test_every_quote_names_a_committed_file_and_how_it_was_made():
  for quote in figures.QUOTES:
    for source in quote.sources:
      path = os.path.join(figures.ROOT, source)
      assert (os.path.isdir if source.endswith("/") else os.path.isfile)(path), source
    assert quote.how in figures.HOW
  two = next(q for q in figures.QUOTES if len(q.sources) == 2)
  assert sorted(two.load()) == sorted(two.sources)  # {path: its results}, one a file
  with pytest.raises(ValueError, match="Quote.how must be one of"):
    figures.Quote("README.md", "x", "y", lambda j: (), "guessed")
