"""A fleet of simulated engines behind the real router (see ``benchmarks/fleet_routing.py``)."""

from benchmarks.fleet_sim.engine import CostModel, EngineSpec, SimEngine, SimRequest
from benchmarks.fleet_sim.routing import ORACLE, OracleRouting, RedisRouting
from benchmarks.fleet_sim.simulator import RunResult, SimConfig, Simulation
from benchmarks.fleet_sim.trace import Trace, TraceConfig, make_trace

__all__ = [
    "ORACLE",
    "CostModel",
    "EngineSpec",
    "OracleRouting",
    "RedisRouting",
    "RunResult",
    "SimConfig",
    "SimEngine",
    "SimRequest",
    "Simulation",
    "Trace",
    "TraceConfig",
    "make_trace",
]
