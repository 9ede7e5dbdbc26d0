"""baton-plugin-suffix passes the speculator conformance suite."""

from __future__ import annotations

from baton.testing.conformance.speculator import SpeculatorConformance


class TestSuffixConformance(SpeculatorConformance):
    name = "suffix"
    history_only = False  # the global trie learns from finished requests
