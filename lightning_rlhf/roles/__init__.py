"""The four roles of RLHF (and a generation-only one for a rollout pool). One role, one class; where each runs is
the strategy's business."""

from lightning_rlhf.roles.actor import ActorRole
from lightning_rlhf.roles.base import Role
from lightning_rlhf.roles.critic import CriticRole
from lightning_rlhf.roles.reference import ReferenceRole, TeacherRole
from lightning_rlhf.roles.reward import RewardFn, RewardFunctionError, RewardRole
from lightning_rlhf.roles.rollout import RolloutRole

__all__ = [
    "ActorRole",
    "CriticRole",
    "ReferenceRole",
    "RewardFn",
    "RewardFunctionError",
    "RewardRole",
    "Role",
    "RolloutRole",
    "TeacherRole",
]
