"""Resource budgets per client: a memory and time model of LoRA training
(:mod:`fedtune.planning.memory`), the planner that turns each client's budget into its method's
knob (:mod:`fedtune.planning.planner`), and the meter a run measures each client with."""
