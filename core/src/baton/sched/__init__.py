"""baton.sched"""
