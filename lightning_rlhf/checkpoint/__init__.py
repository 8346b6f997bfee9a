"""What a run leaves behind: the trained actor exported as a transformers model folder (:mod:`.export`)."""
