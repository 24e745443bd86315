"""The CPU lab: runs verl's own trainer per recipe on a tiny MoE and writes a report."""
