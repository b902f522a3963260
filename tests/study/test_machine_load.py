"""A study's own workers are not a disturbance of each other's units (kvlib.study.machine_load)."""

import os
import subprocess
import sys
import time

import pytest

from kvlib.study import machine_load

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# a second of CPU, then idle until killed (a worker outlives the unit its sibling measures)
BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\ntime.sleep(30)"


def _beside_a_busy_worker(family):
    with machine_load.measured_load(family) as load:
        worker = subprocess.Popen([sys.executable, "-c", BUSY])
        time.sleep(1.8)
    worker.kill()
    worker.wait()
    return load


def test_a_process_of_the_family_is_not_another_process():
    alone = _beside_a_busy_worker(None)  # the worker's second of CPU is another process's
    family = _beside_a_busy_worker(os.getpid())
    assert alone.others_cpu_s >= 0.8
    assert family.others_cpu_s < alone.others_cpu_s - 0.6
