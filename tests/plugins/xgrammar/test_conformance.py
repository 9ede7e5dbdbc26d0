"""baton-plugin-xgrammar passes the structured-output conformance suite."""

from __future__ import annotations

from baton.testing.conformance.structured_output import StructuredOutputConformance


class TestXGrammarConformance(StructuredOutputConformance):
    name = "xgrammar"
