"""baton.metrics"""
