"""baton.transport"""
