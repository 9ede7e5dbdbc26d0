"""baton.frontend"""
