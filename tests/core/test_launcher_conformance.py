"""The engine launcher conformance suite against the built-in ``mp`` launcher (a local process
per engine core, over zmq and over shm)."""

from __future__ import annotations

from baton.testing.conformance import EngineLauncherConformance


class TestProcessLauncherOverZmq(EngineLauncherConformance):
    name = "mp"


class TestProcessLauncherOverShm(EngineLauncherConformance):
    name = "mp"
    transport = "shm"
