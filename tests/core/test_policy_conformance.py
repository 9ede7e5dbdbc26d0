"""The built-in scheduler policies pass the scheduler-policy conformance suite."""

from __future__ import annotations

from baton.testing.conformance.scheduler_policy import SchedulerPolicyConformance


class TestFCFSConformance(SchedulerPolicyConformance):
    name = "fcfs"


class TestPriorityConformance(SchedulerPolicyConformance):
    name = "priority"


class TestSLOConformance(SchedulerPolicyConformance):
    name = "slo"


class TestSLOKeepConformance(SchedulerPolicyConformance):
    name = "slo"
    settings = {"on_miss": "keep"}


class TestFCFSLeastRecomputeConformance(SchedulerPolicyConformance):
    name = "fcfs"
    settings = {"victim": "least_recompute"}
