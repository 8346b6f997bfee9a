"""Engines: how a role's model is trained (``train``) and how rollouts are generated (``rollout``)."""
