"""baton.kv"""
