"""What ``RLHFModule``'s dataflow hooks use beside the roles: the rollouts of a step (dynamic sampling, the pending
rollout of an asynchronous run, :mod:`.rollouts`), its metrics (:mod:`.metrics`) and validation (:mod:`.validation`)."""
