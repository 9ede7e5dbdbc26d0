"""baton.testing.conformance"""
