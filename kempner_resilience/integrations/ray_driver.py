"""Moved to ``kempner_resilience.supervise.ray.driver``; this path keeps working."""

from kempner_resilience.supervise.ray.driver import RayDriver, clear_ray_handlers, driver_forces

__all__ = ["RayDriver", "driver_forces", "clear_ray_handlers"]
