"""baton.cli"""
