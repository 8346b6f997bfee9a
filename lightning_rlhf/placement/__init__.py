"""Where the roles run: device pools and their checks (:mod:`.pools`), the cost model and planner behind
``lightning-rlhf plan`` (:mod:`.planner`), and ``placement="auto"`` (:mod:`.auto`)."""
