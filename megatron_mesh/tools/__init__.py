"""Tools on top of the plan layer (pure Python): the CP-mode planner and its command line."""
