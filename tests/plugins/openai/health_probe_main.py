"""The /health prober that ``probes.HealthProbe`` starts in a child process.

``python health_probe_main.py URL INTERVAL``: prints ``ready`` once it can probe, GETs URL
every INTERVAL seconds until its stdin closes, then prints one JSON line:
``{"latencies": [seconds, ...], "failures": ["...", ...]}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def main(url: str, interval: float) -> None:
    stop = threading.Event()
    # stdin closing is the stop signal (the parent closes it, or dies)
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    latencies: list[float] = []
    failures: list[str] = []
    with httpx.Client(timeout=10) as client:
        print("ready", flush=True)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                status = client.get(url).status_code
            except httpx.HTTPError as e:
                failures.append(repr(e))
            else:
                if status != 200:
                    failures.append(f"status {status}")
            latencies.append(time.monotonic() - t0)
            stop.wait(interval)
    print(json.dumps({"latencies": latencies, "failures": failures}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
