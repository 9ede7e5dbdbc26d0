"""baton.executor"""
