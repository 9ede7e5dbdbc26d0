"""baton.structured"""
