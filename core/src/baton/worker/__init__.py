"""baton.worker"""
