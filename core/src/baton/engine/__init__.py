"""baton.engine"""
