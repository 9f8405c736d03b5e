"""Cost: the symbolic profiler (trace -> cost model -> report), hardware presets and the planner."""
