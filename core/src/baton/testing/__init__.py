"""baton.testing"""
