"""Where the roles run: device pools and their checks (:mod:`.pools`), a module's roles on a placement (:mod:`.roles`),
the cost model (:mod:`.cost_model`) and its calibration (:mod:`.calibration`) behind ``lightning-rlhf plan``
(:mod:`.plan`), and ``placement="auto"`` (:mod:`.auto`)."""
