"""The width policy: what each cycle verifies (policy.py), the "auto" controller, and what
cycles and batched passes cost (costs.py, pass_costs.py)."""
