"""Everything the simulator is: the cluster model (devices, network, clocks,
faults), the reference SimPy interpreter, the compiled engine with symmetry
reduction, and MegaFBD's simulation, behind one entry point, ``simulate``.

Modules outside ``sim`` use the names exported here, never its modules.
"""
from .baseline import bare_simpy_cpu_s_per_event, bare_simpy_events_per_s
from .cluster import clocks_of
from .fbd import check_fbd_scenario, compare_plans, device_clocks, fbd_slots, progress_hook
from .faults import InjectedFaults, fbd_device_faults, injected_faults
from .interpreter import SimDeadlock
from .run import run_sim, run_size
from .simulate import simulate, simulate_iteration_times

__all__ = ["InjectedFaults", "SimDeadlock", "bare_simpy_cpu_s_per_event",
           "bare_simpy_events_per_s", "check_fbd_scenario", "clocks_of", "compare_plans",
           "device_clocks", "fbd_device_faults", "fbd_slots", "injected_faults", "progress_hook",
           "run_sim", "run_size", "simulate", "simulate_iteration_times"]
