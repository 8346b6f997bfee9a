"""The single controller, with no RL in it: the transfer protocols a role method declares (:mod:`.dispatch`), the
worker loop and the controller's calls (:mod:`.controller`), and the liveness of the ranks (:mod:`.liveness`).

Nothing is imported here: :mod:`.dispatch` sits low (the roles and the training engine use it), the rest above the
engines."""
